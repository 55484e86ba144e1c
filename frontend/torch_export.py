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
import importlib.util
import io
import logging
from collections.abc import Callable, Collection
from pathlib import Path

import tvm
from tvm import relax

from ember.core.errors import ModelError
from ember.frontend import trace_cache
from ember.frontend.config import ModelConfig
from ember.frontend.fused_experts import fused_weight_recipe
from ember.frontend.traced_weights import read_weights_transposed
from ember.ir.attributes import FORWARD
from ember.ir.weight_recipes import set_recipes


def build_exported_module(model_dir: Path, config: ModelConfig, model_dtype: str,
                          stored: Collection[str]) -> trace_cache.Traced:
    """The checkpoint in `model_dir`, which stores the tensors named `stored`, as the graph transformers' code
    traces: the Relax `forward` (bounded by the context window) with a recipe per weight parameter, and the shape
    of each checkpoint tensor it loads. `build_module`'s counterpart, with no hand-written model definition; kept
    between compiles by `trace_cache`."""
    if model_dtype != "float32":
        raise ModelError(f"--frontend torch-export builds float32 graphs; {model_dtype} is not supported")
    missing = [package for package in ("torch", "transformers") if importlib.util.find_spec(package) is None]
    if missing:
        raise ModelError(f"--frontend torch-export needs torch and transformers, and this Python has no "
                         f"{' and no '.join(missing)}: pip install torch==2.13.0 transformers")
    config_json = (Path(model_dir) / "config.json").read_bytes()
    return trace_cache.load_or_trace(config_json, config.context_window, stored,
                                     lambda: _trace(model_dir, config.context_window, stored.__contains__))


def _trace(model_dir: Path, context_window: int, stored: Callable[[str], bool]) -> trace_cache.Traced:
    """transformers' model built from `model_dir`'s config.json, traced and imported (`import_module`)."""
    import torch
    import transformers

    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        _check_experts(hf_config, Path(model_dir) / "config.json")
        model = _build_model(transformers.AutoModelForCausalLM, hf_config, torch.float32)
    except (ValueError, KeyError, OSError) as err:
        raise ModelError(f"{Path(model_dir) / 'config.json'}: transformers cannot build this model: "
                         f"{str(err).splitlines()[0]}") from None
    return import_module(model.eval(), context_window, stored=stored)


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _check_experts(config, path: Path) -> None:
    """A mixture of experts that routes each token to more experts than it has, refused before tracing."""
    top_k = getattr(config, "num_experts_per_tok", None)
    counted = next(((key, getattr(config, key)) for key in _EXPERT_COUNTS
                    if isinstance(getattr(config, key, None), int)), None)
    if isinstance(top_k, int) and counted is not None and not 0 < top_k <= counted[1]:
        raise ModelError(f"{path}: num_experts_per_tok is {top_k}, but the model has {counted[1]} experts "
                         f"({counted[0]}): each token must go to between 1 and {counted[1]}")


def _build_model(auto_class, config, dtype):
    """The model with transformers' sdpa attention, whose trace `specialize_attention` reads most directly
    (its written-out, eager, attention where a family has no sdpa path), and its `batched_mm` experts: a gather of
    each token's experts' weights and a batched matmul, static shapes that trace and that `lower_moe` recognises
    (the default, `grouped_mm`, traces into operators TVM's importer does not know).

    Its weights are left uninitialised (`no_init_weights`): the trace never reads them, and memory the process
    never writes is never resident, so a model far larger than this machine's memory is traced in the memory of
    its graph (the importer hands the parameters on by DLPack, without a copy). Buffers that the graph does read
    as constants (rotary frequencies, embedding scales) are computed by the modules' constructors, as before."""
    from transformers.initialization import no_init_weights

    with quiet():
        with no_init_weights():
            try:
                model = auto_class.from_config(config, attn_implementation="sdpa",
                                               experts_implementation="batched_mm", dtype=dtype)
            except ValueError as err:
                if "scaled_dot_product_attention" not in str(err):
                    raise
                model = auto_class.from_config(config, attn_implementation="eager",
                                               experts_implementation="batched_mm", dtype=dtype)
        model.tie_weights()  # skipped with the initialisation it belongs to: a tied head is the embedding
    return model


def import_module(
    model, max_seq_len: int, stored: Callable[[str], bool] = lambda _name: True,
) -> tuple[tvm.IRModule, dict[str, tuple[int, ...]]]:
    """`model` (a transformers causal LM, or any torch module mapping input_ids [1, seq] to an object with
    `.logits` or to the logits) exported and imported as the Relax `forward`; weights named as a checkpoint
    stores them (`_checkpoint_names`), a tied weight by the one of its names that `stored` says the checkpoint has."""
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
        with torch.no_grad(), quiet():
            program = torch.export.export(Logits(), (example,), dynamic_shapes={"input_ids": {1: seq}}, strict=False)
            mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    except Exception as err:  # torch.export and the importer raise many types; one line names the stage
        raise ModelError(f"torch.export of {type(model).__name__} failed: "
                         f"{type(err).__name__}: {str(err).strip().splitlines()[0]}") from None
    checkpoint_name = _checkpoint_names(model, stored)
    names = {spec.arg.name: checkpoint_name(spec.target.removeprefix("model."))
             for spec in program.graph_signature.input_specs
             if spec.kind == torch.export.graph_signature.InputKind.PARAMETER}
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    by_name: dict[str, relax.Var] = {}  # a tied weight is lifted once per name: one parameter for both
    for param in main.params[num_input:]:
        by_name.setdefault(names[param.name], relax.Var(names[param.name], param.ty))
    renamed = list(by_name.values())
    params = [*main.params[:num_input], *renamed]
    body = main.bind_params({p: by_name[names[p.name]] for p in main.params[num_input:]}).body
    seq = main.params[0].ty.shape[1]
    forward = relax.Function(params, body, main.ret_ty, main.is_pure,
                             tvm.ir.make_node("ir.DictAttrs", num_input=num_input,
                                              tir_var_upper_bound={seq.name: max_seq_len}))
    shapes: dict[str, tuple[int, ...]] = {}
    recipes = {}
    for param in renamed:
        shape = tuple(int(d) for d in param.ty.shape)
        if len(shape) == 3 and not stored(param.name):  # experts transformers stacked as it loaded them
            recipes[param.name], pieces = fused_weight_recipe(model, param.name, shape, stored)
            shapes.update(pieces)
        else:
            recipes[param.name] = {"op": "load", "name": param.name}
            shapes[param.name] = shape
    forward, recipes = read_weights_transposed(forward, recipes)
    return set_recipes(tvm.IRModule({FORWARD: forward}), recipes), shapes


def _checkpoint_names(model, stored: Callable[[str], bool]) -> Callable[[str], str]:
    """Parameter name -> the name of the checkpoint tensor it is loaded from.

    transformers renames some tensors between the file and the module (GPT-NeoX's `embed_out` is
    the module's `lm_head`) and undoes that when it saves: the names its own `save_pretrained`
    would write are the file's. A tied weight has several names; the one `stored` says the
    checkpoint has is taken, the module's own name where only it is stored (a GGUF file read
    under transformers' names)."""
    import torch

    state = model.state_dict(keep_vars=True)  # the parameters themselves: tied ones are one object
    saved = {name: name for name in state}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5 renames nothing
        revert_weight_conversion = None
    if revert_weight_conversion is not None and hasattr(model, "config"):
        # Renamed tensors come back as the same objects; a conversion that computes new tensors (a
        # fused expert list, say) names nothing, and the missing checkpoint tensor is reported.
        by_id = {id(tensor): name for name, tensor in state.items()}
        with torch.no_grad():
            reverted = revert_weight_conversion(model, dict(state))
        saved.update({by_id[id(tensor)]: name for name, tensor in reverted.items() if id(tensor) in by_id})
    aliases: dict[int, list[str]] = {}
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(saved[name])
    parameters = dict(model.named_parameters(remove_duplicate=False))

    def checkpoint_name(name: str) -> str:
        candidates = aliases.get(id(parameters[name]), []) if name in parameters else []
        return next((alias for alias in (*candidates, name) if stored(alias)), saved.get(name, name))

    return checkpoint_name


@contextlib.contextmanager
def quiet():
    """transformers and torch.export log and print while they work; a compile shows only its own progress."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
