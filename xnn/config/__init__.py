"""xnn.config"""
