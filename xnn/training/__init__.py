"""xnn.training"""
