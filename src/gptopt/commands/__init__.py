"""The verbs of the command line, one module each (main(cfg) -> int); bench and serve are packages of their own
beside this one. cli.py's table names them.
"""
