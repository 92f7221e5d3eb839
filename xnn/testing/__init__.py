"""xnn.testing"""
