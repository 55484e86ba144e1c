"""The bottom layer: what every other layer may import, and all that the runtime imports from ember.

Errors users see (`errors`), the artifact manifest and its format versions (`manifest`), facts
about this machine (`machine`) and the guard that keeps torch out of TVM's import
(`without_torch`). Nothing here imports the compiler, torch or transformers.
"""
