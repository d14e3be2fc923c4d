"""harts"""
