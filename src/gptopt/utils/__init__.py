"""Plain helpers with no gptopt imports: optional dependencies (extras.py), the log lines (logs.py), figures as
text (tables.py).
"""
