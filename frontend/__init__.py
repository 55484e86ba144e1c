"""Importers: model files in, a Relax IRModule plus a weight recipe out."""
