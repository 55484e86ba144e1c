"""The bottom layer: what every other layer may import, and all that the runtime imports from ember.

Errors users see (`errors`), the artifact manifest and its format versions (`manifest`), facts
about this machine (`machine`), the tokenizer files an artifact carries (`tokenizer_files`), the
guards that keep torch and TVM's compiler out of an import that does not need them
(`without_torch`, `tvm_runtime_only`), and what the caches under ~/.cache/ember share (`caches`).
Nothing here imports the compiler, torch or transformers.
"""
