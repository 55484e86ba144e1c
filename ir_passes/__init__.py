"""Graph passes: IRModule in, IRModule out, one pass per file; `pipeline.py` lists them in order."""
