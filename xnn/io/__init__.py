"""xnn.io"""
