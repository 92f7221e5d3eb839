"""xnn.distributed"""
