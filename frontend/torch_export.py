"""Import a decoder-only LM from the graph its own PyTorch code produces: torch.export, then TVM's importer.

No hand-written model definition: transformers builds the model from `config.json`
(a compile-time dependency only; its weights are never read here, they stay in the
checkpoint and are bound as parameters with recipes, as the hand-written frontend
binds them), `torch.export` traces its forward over a full token sequence (no cache
inputs: one sequence, `seq` tokens, logits at every position), and TVM's
`from_exported_program` turns the trace into a Relax function

    forward(input_ids[1, seq], *weights) -> logits[1, seq, vocab]

whose weight parameters carry the checkpoint's tensor names. `ir_passes/specialize_attention.py`
then finds the causal self-attention in it and gives it the paged KV cache, which
makes the `prefill` / `decode` / `verify` entries the runtime calls.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import tvm
from tvm import relax

from ember.errors import ModelError
from ember.frontend.config import ModelConfig, parse_model_config
from ember.frontend.files import checkpoint_file, optional_checkpoint_file, read_json_object
from ember.frontend.weights import CheckpointWeights
from ember.frontend.kv_cache import CacheShape, KVCacheFactory, create_spec
from ember.frontend.library_kernels import tag_library_kernels
from ember.ir_passes.module_utils import ROPE_ATTR, bindings, is_op
from ember.ir_passes.specialize_attention import attention_heads, specialize_attention
from ember.ir_passes.weight_recipes import set_recipes

FORWARD = "forward"


def export_checkpoint(model_dir: Path, max_seq_len: int) -> tuple[tvm.IRModule, dict[str, tuple[int, ...]]]:
    """The Relax `forward` of the transformers model `model_dir/config.json` describes, with a recipe
    per weight parameter, and the shape of each checkpoint tensor it loads."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        with _quiet():
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                  dtype=torch.float32)
    except (ValueError, KeyError, OSError) as err:
        raise ModelError(f"{Path(model_dir) / 'config.json'}: transformers cannot build this model: "
                         f"{str(err).splitlines()[0]}") from None
    stored = CheckpointWeights(model_dir).records
    return import_module(model.eval(), max_seq_len, stored=stored.__contains__)


def import_module(model, max_seq_len: int, stored=lambda _name: True) -> tuple[tvm.IRModule, dict[str, tuple[int, ...]]]:
    """`model` (a transformers causal LM, or any torch module mapping input_ids [1, seq] to an object with
    `.logits` or to the logits) exported and imported as the Relax `forward`; weights named as in its state
    dict, a tied weight by the one of its names that `stored` says the checkpoint has."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            out = self.model(input_ids=input_ids, use_cache=False)
            return out if isinstance(out, torch.Tensor) else out.logits

    seq = torch.export.Dim("seq", min=2, max=max_seq_len)
    example = torch.zeros((1, 3), dtype=torch.int32)  # 3 tokens: neither 0 nor 1, so `seq` stays symbolic
    try:
        with torch.no_grad(), _quiet():
            program = torch.export.export(Logits(), (example,), dynamic_shapes={"input_ids": {1: seq}}, strict=False)
            mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    except Exception as err:  # torch.export and the importer raise many types; one line names the stage
        raise ModelError(f"torch.export of {type(model).__name__} failed: "
                         f"{type(err).__name__}: {str(err).strip().splitlines()[0]}") from None
    aliases: dict[int, list[str]] = {}  # tied weights: one tensor under several names
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
    tensors = dict(model.named_parameters(remove_duplicate=False))

    def checkpoint_name(target: str) -> str:
        name = target.removeprefix("model.")
        return next((alias for alias in aliases.get(id(tensors.get(name)), [name]) if stored(alias)), name)

    names = {spec.arg.name: checkpoint_name(spec.target) for spec in program.graph_signature.input_specs
             if spec.kind == torch.export.graph_signature.InputKind.PARAMETER}
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    by_name: dict[str, relax.Var] = {}  # a tied weight is lifted once per name: one parameter for both
    for param in main.params[num_input:]:
        by_name.setdefault(names[param.name], relax.Var(names[param.name], param.ty))
    renamed = list(by_name.values())
    params = [*main.params[:num_input], *renamed]
    body = main.bind_params({p: by_name[names[p.name]] for p in main.params[num_input:]}).body
    forward = relax.Function(params, body, main.ret_ty, main.is_pure,
                             tvm.ir.make_node("ir.DictAttrs", num_input=num_input))
    shapes = {p.name: tuple(int(d) for d in p.ty.shape) for p in renamed}
    recipes = {p.name: {"op": "load", "name": p.name} for p in renamed}
    forward, transposed = _weights_read_transposed(forward)
    for name in transposed:
        recipes[name] = {"op": "transpose", "input": recipes[name]}
    return set_recipes(tvm.IRModule({FORWARD: forward}), recipes), shapes


def _weights_read_transposed(func: relax.Function) -> tuple[relax.Function, list[str]]:
    """`func` with each 2-D weight it only multiplies as x @ W (transformers' Conv1D: GPT-2 stores its
    projections [in, out]) taken as [out, in] and read as x @ permute_dims(W): the form ember's projection
    passes (fusion, quantization, panels) match. Returns the weights it transposed."""
    num_input = int(func.attrs["num_input"])
    weights = set(func.params[num_input:])
    right_operands, other_uses = set(), set()
    for binding in bindings(func):
        value = binding.value
        if is_op(value, "relax.matmul") and value.args[1] in weights and len(value.args[1].ty.shape) == 2:
            right_operands.add(value.args[1])
            reads = [value.args[0]]
        else:
            reads = [value]
        other_uses |= {var for var in relax.analysis.free_vars(relax.Tuple(reads)) if var in weights}
    chosen = right_operands - other_uses
    if not chosen:
        return func, []
    stored = {w: relax.Var(w.name, relax.TensorType(list(w.ty.shape)[::-1], w.ty.dtype)) for w in chosen}
    body = _ReadTransposed(stored).visit_expr(func.body)
    params = [stored.get(p, p) for p in func.params]
    return relax.Function(params, body, None, func.is_pure, func.attrs), [w.name for w in chosen]


@relax.expr_functor.mutator
class _ReadTransposed(relax.PyExprMutator):
    def __init__(self, stored: dict[relax.Var, relax.Var]) -> None:
        super().__init__()
        self.stored = stored

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_op(value, "relax.matmul") and value.args[1] in self.stored:
            weight = self.builder_.emit(relax.op.permute_dims(self.stored[value.args[1]]))
            product = relax.op.matmul(self.visit_expr(value.args[0]), weight, value.attrs.out_dtype)
            emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
            self.set_var_remap(binding.var, emit(product))
            return
        super().visit_var_binding_(binding)


@contextlib.contextmanager
def _quiet():
    """transformers and torch.export log and print while they work; a compile shows only its own progress."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


# The config keys every architecture has under some name, which transformers' config classes resolve.
_SIZE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")


def exported_model_config(model_dir: Path) -> ModelConfig:
    """The sizes ember needs of any transformers architecture: its config read by transformers (which
    resolves each family's own key names, GPT-2's `n_embd` as `hidden_size`), checked by ember's schema."""
    import transformers

    path = checkpoint_file(model_dir, "config.json")
    raw = read_json_object(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ModelError(f"{path}: transformers cannot read this config: {str(err).splitlines()[0]}") from None
    canonical = {key: getattr(config, key) for key in _SIZE_KEYS if getattr(config, key, None) is not None}
    canonical.setdefault("intermediate_size", getattr(config, "n_inner", None) or 4 * config.hidden_size)
    generation_path = optional_checkpoint_file(model_dir, "generation_config.json")
    generation = read_json_object(generation_path) if generation_path else {}
    return parse_model_config({**raw, **canonical}, path, generation, generation_path, any_architecture=True)


def build_exported_module(model_dir: Path, config: ModelConfig, target: tvm.target.Target,
                          model_dtype: str) -> tuple[tvm.IRModule, dict[str, tuple[int, ...]]]:
    """ember's entries for the checkpoint in `model_dir`, from its exported graph: `build_module`'s
    result, with no hand-written model definition."""
    if model_dtype != "float32":
        raise ModelError(f"--frontend torch-export builds float32 graphs; {model_dtype} is not supported")
    forward, shapes = export_checkpoint(model_dir, config.context_window)
    # torch.export traces one view of an activation per reader (q, k and v each reshape the normed input):
    # as one binding, projections that share their input can be fused.
    forward = relax.transform.EliminateCommonSubexpr()(forward)
    heads = attention_heads(forward)
    expected = {"num_layers": config.num_hidden_layers, "num_heads": config.num_attention_heads,
                "num_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim}
    if heads != expected:
        raise ModelError(f"{Path(model_dir) / 'config.json'}: the exported graph's attention ({heads}) "
                         f"differs from the config's ({expected})")
    entries = specialize_attention(forward)
    shape = CacheShape(heads["num_layers"], heads["num_heads"], heads["num_kv_heads"], heads["head_dim"],
                       config.context_window)
    cache, _ = KVCacheFactory(shape, model_dtype, target).export_tvm(spec={"create_paged_kv_cache": create_spec()})
    functions = {gv.name_hint: func for gv, func in entries.functions_items()}
    functions.update({gv.name_hint: func for gv, func in tag_library_kernels(cache).functions_items()})
    module = tvm.IRModule(functions, attrs=entries.attrs)
    return module.with_attr(ROPE_ATTR, {"mode": "in-graph", "sliding_window": False}), shapes
