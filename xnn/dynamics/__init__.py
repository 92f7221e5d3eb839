"""xnn.dynamics"""
