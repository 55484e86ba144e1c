"""Import a decoder-only LM from an ONNX file: its full-sequence forward, as `torch.onnx.export` writes it.

The file holds one graph, `logits[1, seq, vocab] = f(input_ids[1, seq])`, with the
weights as initializers (in the file, or in external data files beside it). ember
converts it into the Relax function

    forward(input_ids[1, seq], *weights) -> logits[1, seq, vocab]

that `ir_passes/specialize_attention.py` turns into the entries over the paged KV
cache, as it does for `torch.export` (`frontend/torch_export.py`). The tokenizer,
context length and token ids come from a Hugging Face directory (`--tokenizer DIR`,
by default the file's own directory).

The nodes are converted here rather than by TVM's `relax.frontend.onnx`: the
graphs exporters write for transformers' models compute masks and positions from
the sequence length (Shape, Gather, Range, Reshape of a scalar, Expand to a computed
shape), and TVM 0.27's importer loses the symbolic length on the way (a Reshape of
a shape scalar, a Squeeze without axes, shapes unknown after an Unsqueeze). Here a
value computed from shapes and constants alone is kept as a *known value*: a numpy
array whose entries are integers or expressions of the symbolic sequence length,
evaluated (and simplified, knowing 1 <= seq <= the context window) while
converting. Only what depends on the tokens or the weights becomes Relax operators,
each with a static or symbolic shape. Weights are the floating-point initializers
of one or more dimensions, bound as parameters with recipes that read them from
the file; every other initializer is a known value.

Each refusal names the file and the node (its op type and name): an operator ember
does not convert, a graph input other than the token ids, a subgraph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.sym import Analyzer

from ember.core.errors import ModelError
from ember.core.files import check_file_size, checkpoint_file
from ember.frontend.config import imported_model_config
from ember.frontend.hf import ImportedModel, checked_tokenizer_files
from ember.frontend.traced_weights import read_weights_transposed
from ember.ir.attributes import CONFIG_WINDOWS_ATTR, FORWARD
from ember.ir.weight_recipes import set_recipes

MAX_ONNX_BYTES = 2**31  # protobuf's limit: larger models keep their weights in external data files
_INDEX_END = 2**31  # Slice ends at or past this mean "to the end"
# ONNX TensorProto data types ember reads (onnx.TensorProto.DataType).
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
           11: "float64", 16: "bfloat16"}
_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ModelError("compiling an ONNX file needs the onnx package: pip install 'ember[onnx]'") from None
    return onnx


def load_onnx(path: Path):
    """The ModelProto of `path`, its weights left in their files; a file that is not ONNX is refused in one line."""
    onnx = _onnx()
    check_file_size(path, MAX_ONNX_BYTES)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # protobuf's DecodeError and friends: the file is not an ONNX model
        raise ModelError(f"{path}: not an ONNX model ({type(err).__name__}: {str(err).strip()[:200]})") from None
    if not model.graph.node:
        raise ModelError(f"{path}: not an ONNX model (no graph nodes)")
    return model


@dataclass(frozen=True)
class OnnxTensor:
    """One initializer used as a weight: where its bytes are (an external file's range, or inside the model)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    path: Path | None  # None: stored inside the ONNX file
    offset: int = 0
    nbytes: int = 0


class OnnxWeights:
    """The weights of an ONNX file, read lazily by name (external data is memory-mapped, checked to lie
    inside the model's directory and inside its file)."""

    def __init__(self, path: Path, model) -> None:
        self.path = Path(path)
        self._protos = {t.name: t for t in model.graph.initializer}
        self.records: dict[str, OnnxTensor] = {}
        for tensor in model.graph.initializer:
            dtype = _DTYPES.get(tensor.data_type)
            if dtype in _FLOAT_DTYPES and len(tensor.dims) >= 1:
                self.records[tensor.name] = self._record(tensor, _numpy_dtype(dtype))

    def _record(self, tensor, dtype: np.dtype) -> OnnxTensor:
        shape = tuple(int(d) for d in tensor.dims)
        nbytes = math.prod(shape) * dtype.itemsize
        where = f"{self.path}: initializer {tensor.name!r}"
        if tensor.data_location != 1:  # stored in the model itself
            return OnnxTensor(tensor.name, dtype, shape, None)
        info = {entry.key: entry.value for entry in tensor.external_data}
        if "location" not in info:
            raise ModelError(f"{where}: external data without a location")
        data_path = checkpoint_file(self.path.parent, info["location"], listed_in=self.path)
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", nbytes))
        except ValueError:
            raise ModelError(f"{where}: external data offset/length are not integers") from None
        if length != nbytes or offset < 0 or offset + length > data_path.stat().st_size:
            raise ModelError(f"{where}: {list(shape)} {dtype} needs {nbytes} bytes, but its external data is "
                             f"{length} bytes at offset {offset} of {data_path.name} "
                             f"({data_path.stat().st_size} bytes)")
        return OnnxTensor(tensor.name, dtype, shape, data_path, offset, nbytes)

    def record(self, name: str) -> OnnxTensor:
        """The location of `name`, or a `ModelError` that names the missing initializer."""
        if name not in self.records:
            raise ModelError(f"{self.path}: no floating-point initializer {name!r} in the ONNX file")
        return self.records[name]

    def load(self, name: str) -> np.ndarray:
        """Read one weight into memory."""
        record = self.record(name)
        if record.path is None:
            values = _onnx().numpy_helper.to_array(self._protos[name])
            if values.shape != record.shape:
                raise ModelError(
                    f"{self.path}: initializer {name!r} holds {values.size} values, not {list(record.shape)}")
            return np.asarray(values, record.dtype)
        data = np.memmap(record.path, dtype=np.uint8, mode="r", offset=record.offset, shape=(record.nbytes,))
        return np.array(data.view(record.dtype).reshape(record.shape))


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def import_onnx_model(path: Path, tokenizer_dir: Path | None, model_dtype: str = "float32") -> ImportedModel:
    """The ONNX file `path` as ember's graph IR, with the tokenizer, context window and token ids of the Hugging
    Face directory `tokenizer_dir` (default: the file's own directory)."""
    path = Path(path)
    if model_dtype != "float32":
        raise ModelError(f"{path}: an ONNX graph is imported in float32; {model_dtype} is not supported")
    directory = Path(tokenizer_dir) if tokenizer_dir is not None else path.parent
    if not directory.is_dir():
        raise ModelError(f"--tokenizer {directory}: not a directory (expected the model's Hugging Face directory: "
                         "config.json and tokenizer files)")
    if not (directory / "config.json").is_file():
        raise ModelError(f"{directory / 'config.json'}: file not found (an ONNX file takes its config and tokenizer "
                         "from --tokenizer DIR, by default its own directory)")
    config = imported_model_config(directory)
    model = load_onnx(path)
    weights = OnnxWeights(path, model)
    mod, _shapes = build_onnx_module(path, model, weights, config.context_window)
    mod = mod.with_attr(CONFIG_WINDOWS_ATTR, list(config.layer_windows))
    return ImportedModel(mod, config, weights, checked_tokenizer_files(directory, config), model_dtype, "onnx",
                         directory)


def build_onnx_module(path: Path, model, weights: OnnxWeights,
                      max_seq_len: int) -> tuple[tvm.IRModule, dict[str, tuple[int, ...]]]:
    """The Relax `forward` of the ONNX `model` (bounded by `max_seq_len` tokens), with a recipe per weight,
    and the shape of each weight."""
    converter = _Converter(path, model, weights, max_seq_len)
    forward = converter.convert()
    recipes = {name: {"op": "load", "name": name} for name in converter.weight_names}
    forward, recipes = read_weights_transposed(forward, recipes)
    shapes = {name: weights.record(name).shape for name in converter.weight_names}
    return set_recipes(tvm.IRModule({FORWARD: forward}), recipes), shapes


@dataclass(frozen=True)
class Known:
    """A value computed while converting: a numpy array (object dtype where an entry is an expression of the
    sequence length) and its ONNX dtype."""

    values: np.ndarray
    dtype: str

    @property
    def symbolic(self) -> bool:
        return self.values.dtype == object


Value = Known | relax.Expr


class _Converter:
    """One ONNX graph into one Relax function."""

    def __init__(self, path: Path, model, weights: OnnxWeights, max_seq_len: int) -> None:
        self.path, self.weights = path, weights
        self.graph = model.graph
        self.seq = tirx.Var("seq", "int64")
        self.analyzer = Analyzer()
        self.analyzer.bind(self.seq, tvm.ir.Range(tirx.IntImm("int64", 1), tirx.IntImm("int64", max_seq_len + 1)))
        self.max_seq_len = max_seq_len
        self.values: dict[str, Value] = {}
        self.weight_names: list[str] = []
        self.builder = relax.BlockBuilder()
        self.node_where = str(path)

    # --- the graph ---------------------------------------------------------------------------------------

    def convert(self) -> relax.Function:
        onnx = _onnx()
        inputs = [i for i in self.graph.input if i.name not in {t.name for t in self.graph.initializer}]
        if len(inputs) != 1:
            names = ", ".join(i.name for i in inputs)
            raise ModelError(f"{self.path}: the graph takes {len(inputs)} inputs ({names}); ember compiles the "
                             "forward of the token ids alone (export it without attention_mask, position_ids "
                             "or past key/values)")
        token_input = inputs[0]
        dtype = _DTYPES.get(token_input.type.tensor_type.elem_type)
        dims = token_input.type.tensor_type.shape.dim
        if dtype not in ("int64", "int32") or len(dims) != 2 or (dims[0].HasField("dim_value")
                                                                   and dims[0].dim_value != 1):
            raise ModelError(f"{self.path}: input {token_input.name!r} must be integer token ids of shape "
                             f"[1, seq]")
        used = {name for node in self.graph.node for name in node.input}
        for tensor in self.graph.initializer:
            if tensor.name in self.weights.records and tensor.name in used:
                self.weight_names.append(tensor.name)
            elif tensor.name in used:
                if tensor.data_type not in _DTYPES or tensor.data_location == 1:
                    raise ModelError(f"{self.path}: initializer {tensor.name!r}: a constant of ONNX data type "
                                     f"{tensor.data_type}{' in external data' * (tensor.data_location == 1)} "
                                     "is not supported")
                self.values[tensor.name] = Known(onnx.numpy_helper.to_array(tensor).copy(), _DTYPES[tensor.data_type])
        ids = relax.Var("input_ids", relax.TensorType([1, self.seq], "int32"))
        params = [relax.Var(name, relax.TensorType(list(self.weights.record(name).shape),
                                                                   str(self.weights.record(name).dtype)))
                  for name in self.weight_names]
        self.values.update(zip(self.weight_names, params))
        try:
            with self.builder.function(FORWARD, [ids, *params], {"num_input": 1,
                                                                 "tir_var_upper_bound": {"seq": self.max_seq_len}}):
                with self.builder.dataflow():
                    self.values[token_input.name] = self.emit(relax.op.astype(ids, dtype))
                    for index, node in enumerate(self.graph.node):
                        self.node_where = f"{self.path}: node {index} ({node.op_type} {node.name!r})"
                        self._convert_node(node)
                    out = self.builder.emit_output(self._output())
                self.builder.emit_func_output(out)
        except BaseException:
            # A function left half built keeps its outer block and scope open, and TVM warns when the builder
            # is destroyed so: close them, so that a refusal is the one line it says.
            self.builder._end_block()
            self.builder.end_scope()
            raise
        return self.builder.get()[FORWARD]

    def _output(self) -> relax.Expr:
        name = self.graph.output[0].name
        logits = self.tensor(self.values[name]) if name in self.values else None
        if logits is None or len(logits.ty.shape) != 3:
            raise ModelError(f"{self.path}: output {name!r} must be the logits [1, seq, vocab]")
        return logits if logits.ty.dtype == "float32" else self.emit(relax.op.astype(logits, "float32"))

    def _convert_node(self, node) -> None:
        onnx = _onnx()
        if node.domain not in ("", "ai.onnx"):
            raise self.error(f"operator domain {node.domain!r} is not converted (only standard ONNX operators)")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if any(isinstance(v, onnx.GraphProto) for v in attrs.values()):
            raise self.error("subgraphs (If, Loop, Scan) are not converted")
        convert = _CONVERTERS.get(node.op_type)
        if convert is None:
            raise self.error("operator not converted by ember's ONNX frontend")
        missing = [name for name in node.input if name and name not in self.values]
        if missing:
            raise self.error(f"input {missing[0]!r} is not the graph's input, an initializer or an earlier "
                             "node's output")
        inputs = [self.values[name] if name else None for name in node.input]
        try:
            outputs = convert(self, inputs, attrs)
        except (ValueError, TypeError, IndexError, KeyError, RuntimeError) as err:  # TVM raises RuntimeErrors
            # Shapes or attributes that do not fit the operator (a file from elsewhere): one line, not a traceback.
            reason = str(err).strip().splitlines() or [""]
            raise self.error(f"cannot convert: {type(err).__name__}: {reason[-1][:300]}") from None
        outputs = outputs if isinstance(outputs, list) else [outputs]
        for name, value in zip(node.output, outputs):
            if name:
                self.values[name] = value

    def error(self, reason: str) -> ModelError:
        return ModelError(f"{self.node_where}: {reason}")

    # --- values ------------------------------------------------------------------------------------------

    def emit(self, expr: relax.Expr) -> relax.Expr:
        return self.builder.emit(expr)

    def simplify(self, value):
        """An integer, or a simplified expression of the sequence length."""
        if isinstance(value, tirx.Expr):
            value = self.analyzer.simplify(value)
            return int(value) if isinstance(value, tirx.IntImm) else value
        return value

    def tensor(self, value: Value) -> relax.Expr:
        """`value` as a Relax tensor."""
        if not isinstance(value, Known):
            return value
        if not value.symbolic:
            return relax.const(value.values, value.dtype)
        flat = relax.op.shape_to_tensor(relax.ShapeExpr([tirx.IntImm("int64", v) if isinstance(v, int) else v
                                                         for v in value.values.reshape(-1)]))
        out = self.emit(relax.op.reshape(self.emit(flat), list(value.values.shape)))
        return out if value.dtype == "int64" else self.emit(relax.op.astype(out, value.dtype))

    def shape_of(self, value: Value) -> list:
        """The dimensions of `value`: integers or expressions of the sequence length."""
        if isinstance(value, Known):
            return list(value.values.shape)
        return [self.simplify(d) for d in value.ty.shape]

    def ints(self, value: Value | None, what: str) -> list:
        """A known list of integers (or expressions): axes, shapes, slice bounds."""
        if value is None:
            return []
        if not isinstance(value, Known):
            raise self.error(f"{what} must be computable from shapes and constants, not from the tokens or weights")
        return [self.simplify(v) for v in value.values.reshape(-1).tolist()]

    def axis(self, axis: int, rank: int) -> int:
        if not -rank <= axis < rank:
            raise self.error(f"axis {axis} is out of range for rank {rank}")
        return axis % rank

    def decide(self, condition) -> bool | None:
        """True or False where the analyzer can tell, else None."""
        value = self.simplify(condition)
        return bool(value) if isinstance(value, int | bool | np.bool_) else None


def _dtype_of(data_type: int) -> str:
    dtype = _DTYPES.get(data_type)
    if dtype is None:  # a converter's ValueError names its node
        raise ValueError(f"ONNX data type {data_type} is not supported")
    return dtype


# --- converters: (converter, inputs, attributes) -> output value(s) ------------------------------------------

_CONVERTERS: dict[str, Callable] = {}


def _converter(*names: str):
    def register(func):
        for name in names:
            _CONVERTERS[name] = func
        return func
    return register


def _known_elementwise(c: _Converter, inputs: list[Known], func: Callable, dtype: str) -> Known | None:
    """`func` applied to known inputs entry by entry (broadcast); None where a comparison cannot be decided."""
    arrays = np.broadcast_arrays(*[k.values for k in inputs])
    if not any(k.symbolic for k in inputs):
        return Known(np.asarray(func(*arrays)).astype(_numpy_dtype(dtype)), dtype)
    out = np.empty(arrays[0].shape, dtype=object)
    for index in np.ndindex(out.shape):
        value = c.simplify(func(*[a[index] for a in arrays]))  # a number, or an expression of the length
        if dtype == "bool" and isinstance(value, tirx.Expr):
            return None
        out[index] = value
    if dtype == "bool" or all(isinstance(v, int) for v in out.reshape(-1)):
        return Known(out.astype(_numpy_dtype(dtype)), dtype)
    return Known(out, dtype)


def _binary(numpy_func: Callable, relax_func: Callable, result_dtype: str | None = None):
    def convert(c: _Converter, inputs: list[Value], _attrs: dict) -> Value:
        a, b = inputs
        dtype = result_dtype or (a.dtype if isinstance(a, Known) else str(a.ty.dtype))
        if isinstance(a, Known) and isinstance(b, Known):
            known = _known_elementwise(c, [a, b], numpy_func, dtype)
            if known is not None:
                return known
        return c.emit(relax_func(c.tensor(a), c.tensor(b)))
    return convert


def _divide(x, y):
    """ONNX Div: integers truncate toward zero."""
    if isinstance(x, tirx.Expr) or isinstance(y, tirx.Expr):
        return tirx.truncdiv(x, y)
    if np.issubdtype(np.result_type(x, y), np.integer):
        return (np.abs(x) // np.abs(y)) * np.sign(x) * np.sign(y)
    return np.divide(x, y)


def _either(symbolic: Callable, numeric: Callable) -> Callable:
    """`symbolic` where an operand is an expression of the sequence length, else `numeric`."""
    return lambda x, y: symbolic(x, y) if isinstance(x, tirx.Expr) or isinstance(y, tirx.Expr) else numeric(x, y)


_CONVERTERS.update({
    "Add": _binary(lambda x, y: x + y, relax.op.add),
    "Sub": _binary(lambda x, y: x - y, relax.op.subtract),
    "Mul": _binary(lambda x, y: x * y, relax.op.multiply),
    "Div": _binary(_divide, relax.op.divide),
    "Max": _binary(_either(tirx.max, np.maximum), relax.op.maximum),
    "Min": _binary(_either(tirx.min, np.minimum), relax.op.minimum),
    "Pow": _binary(np.power, relax.op.power),
    "Equal": _binary(lambda x, y: x == y, relax.op.equal, "bool"),
    "Less": _binary(lambda x, y: x < y, relax.op.less, "bool"),
    "LessOrEqual": _binary(lambda x, y: x <= y, relax.op.less_equal, "bool"),
    "Greater": _binary(lambda x, y: x > y, relax.op.greater, "bool"),
    "GreaterOrEqual": _binary(lambda x, y: x >= y, relax.op.greater_equal, "bool"),
    "And": _binary(np.logical_and, relax.op.logical_and, "bool"),
    "Or": _binary(np.logical_or, relax.op.logical_or, "bool"),
})


def _unary(numpy_func: Callable | None, relax_func: Callable, result_dtype: str | None = None):
    def convert(c: _Converter, inputs: list[Value], _attrs: dict) -> Value:
        x = inputs[0]
        if numpy_func is not None and isinstance(x, Known) and not x.symbolic:
            return Known(np.asarray(numpy_func(x.values)), result_dtype or x.dtype)
        return c.emit(relax_func(c.tensor(x)))
    return convert


_CONVERTERS.update({
    "Neg": _unary(np.negative, relax.op.negative),
    "Not": _unary(np.logical_not, relax.op.logical_not),
    "Abs": _unary(np.abs, relax.op.abs),
    "Sqrt": _unary(np.sqrt, relax.op.sqrt),
    "Reciprocal": _unary(np.reciprocal, lambda x: relax.op.divide(relax.const(1.0, str(x.ty.dtype)), x)),
    "Exp": _unary(np.exp, relax.op.exp),
    "Log": _unary(np.log, relax.op.log),
    "Cos": _unary(np.cos, relax.op.cos),
    "Sin": _unary(np.sin, relax.op.sin),
    "Tanh": _unary(np.tanh, relax.op.tanh),
    "Erf": _unary(None, relax.op.erf),
    "Sigmoid": _unary(None, relax.op.sigmoid),
    "Relu": _unary(None, relax.op.nn.relu),
    "Floor": _unary(np.floor, relax.op.floor),
    "Ceil": _unary(np.ceil, relax.op.ceil),
    "IsNaN": _unary(np.isnan, relax.op.isnan, "bool"),
    "IsInf": _unary(np.isinf, relax.op.isinf, "bool"),
})


@_converter("Identity")
def _identity(c: _Converter, inputs: list[Value], _attrs: dict) -> Value:
    return inputs[0]


@_converter("Constant")
def _constant(c: _Converter, _inputs: list[Value], attrs: dict) -> Value:
    onnx = _onnx()
    if "value" in attrs:
        return Known(onnx.numpy_helper.to_array(attrs["value"]).copy(), _dtype_of(attrs["value"].data_type))
    for key, dtype in (("value_float", "float32"), ("value_floats", "float32"), ("value_int", "int64"),
                       ("value_ints", "int64")):
        if key in attrs:
            return Known(np.asarray(attrs[key], dtype), dtype)
    raise c.error(f"a Constant with {sorted(attrs)} is not converted")


@_converter("Shape")
def _shape(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    dims = c.shape_of(inputs[0])
    rank = len(dims)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    values = dims[max(0, start + rank if start < 0 else start):end + rank if end < 0 else min(end, rank)]
    symbolic = any(isinstance(d, tirx.Expr) for d in values)
    return Known(np.array(values, dtype=object if symbolic else np.int64), "int64")


@_converter("Cast")
def _cast(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    dtype = _dtype_of(attrs["to"])
    x = inputs[0]
    if isinstance(x, Known) and (not x.symbolic or dtype in ("int64", "int32")):
        return Known(x.values if x.symbolic else x.values.astype(_numpy_dtype(dtype)), dtype)
    return c.emit(relax.op.astype(c.tensor(x), dtype))


@_converter("Gather")
def _gather(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    data, indices = inputs
    dims = c.shape_of(data)
    axis = c.axis(attrs.get("axis", 0), len(dims))
    if isinstance(indices, Known):
        extent = dims[axis]
        if (indices.values < 0).any() if not indices.symbolic else False:
            if not isinstance(extent, int):
                raise c.error("negative indices into an axis of symbolic length")
            indices = Known(indices.values % extent, indices.dtype)
        if isinstance(data, Known):
            return Known(np.take(data.values, indices.values.astype(np.int64), axis=axis), data.dtype)
    return c.emit(relax.op.take(c.tensor(data), c.tensor(indices), axis=axis))


@_converter("GatherND")
def _gather_nd(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    data, indices = inputs
    return c.emit(relax.op.gather_nd(c.tensor(data), c.tensor(indices), attrs.get("batch_dims", 0)))


@_converter("Unsqueeze")
def _unsqueeze(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x = inputs[0]
    axes = c.ints(inputs[1], "Unsqueeze's axes") if len(inputs) > 1 else list(attrs["axes"])
    rank = len(c.shape_of(x)) + len(axes)
    axes = sorted(c.axis(a, rank) for a in axes)
    if isinstance(x, Known):
        values = x.values
        for a in axes:
            values = np.expand_dims(values, a)
        return Known(values, x.dtype)
    return c.emit(relax.op.expand_dims(x, axes))


@_converter("Squeeze")
def _squeeze(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x = inputs[0]
    dims = c.shape_of(x)
    if len(inputs) > 1 and inputs[1] is not None:
        axes = c.ints(inputs[1], "Squeeze's axes")
    else:
        axes = list(attrs.get("axes", [i for i, d in enumerate(dims) if d == 1]))
    axes = [c.axis(a, len(dims)) for a in axes]
    if isinstance(x, Known):
        return Known(np.squeeze(x.values, axis=tuple(axes)), x.dtype)
    return c.emit(relax.op.squeeze(x, axes))


@_converter("Concat")
def _concat(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    rank = len(c.shape_of(inputs[0]))
    axis = c.axis(attrs["axis"], rank)
    if all(isinstance(x, Known) for x in inputs):
        symbolic = any(x.symbolic for x in inputs)
        arrays = [x.values.astype(object) if symbolic else x.values for x in inputs]
        return Known(np.concatenate(arrays, axis=axis), inputs[0].dtype)
    return c.emit(relax.op.concat([c.tensor(x) for x in inputs], axis=axis))


@_converter("Reshape")
def _reshape(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x, shape = inputs
    dims = c.shape_of(x)
    target = c.ints(shape, "Reshape's shape")
    if not attrs.get("allowzero", 0):
        target = [dims[i] if d == 0 else d for i, d in enumerate(target)]
    if isinstance(x, Known):
        if -1 in target:
            known = [d for d in target if d != -1]
            total = math.prod(x.values.shape)
            rest = math.prod(known) if all(isinstance(d, int) for d in known) else None
            if rest is None:
                return c.emit(relax.op.reshape(c.tensor(x), target))
            target = [total // rest if d == -1 else d for d in target]
        if all(isinstance(d, int) for d in target):
            return Known(x.values.reshape(target), x.dtype)
    return c.emit(relax.op.reshape(c.tensor(x), target))


@_converter("Expand")
def _expand(c: _Converter, inputs: list[Value], _attrs: dict) -> Value:
    x, shape = inputs
    target = c.ints(shape, "Expand's shape")
    dims = c.shape_of(x)
    rank = max(len(dims), len(target))
    dims = [1] * (rank - len(dims)) + dims
    target = [1] * (rank - len(target)) + target
    out = []
    for have, want in zip(dims, target):
        if c.decide(want == 1):
            out.append(have)
        else:
            out.append(want)
    if isinstance(x, Known) and all(isinstance(d, int) for d in out):
        return Known(np.broadcast_to(x.values, out).copy(), x.dtype)
    return c.emit(relax.op.broadcast_to(c.tensor(x), out))


@_converter("Range")
def _range(c: _Converter, inputs: list[Value], _attrs: dict) -> Value:
    start, limit, delta = (c.ints(v, "Range's bounds")[0] for v in inputs)
    dtype = inputs[0].dtype if isinstance(inputs[0], Known) else str(inputs[0].ty.dtype)
    if all(isinstance(v, int | float) for v in (start, limit, delta)):
        return Known(np.arange(start, limit, delta, dtype=_numpy_dtype(dtype)), dtype)
    return c.emit(relax.op.arange(start, limit, delta, dtype))


@_converter("ConstantOfShape")
def _constant_of_shape(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    onnx = _onnx()
    shape = c.ints(inputs[0], "ConstantOfShape's shape")
    fill = onnx.numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    dtype = str(fill.dtype)
    if all(isinstance(d, int) for d in shape):
        return Known(np.full(shape, fill.reshape(-1)[0], fill.dtype), dtype)
    return c.emit(relax.op.full(shape, relax.const(fill.reshape(-1)[0], dtype), dtype))


@_converter("Slice")
def _slice(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x = inputs[0]
    dims = c.shape_of(x)
    starts = c.ints(inputs[1], "Slice's starts")
    ends = c.ints(inputs[2], "Slice's ends")
    axes = c.ints(inputs[3], "Slice's axes") if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
    steps = c.ints(inputs[4], "Slice's steps") if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    axes = [c.axis(a, len(dims)) for a in axes]
    if any(not isinstance(s, int) or s <= 0 for s in steps):
        raise c.error(f"Slice steps {steps}: only positive constant steps are converted")
    begin, end = [], []
    for axis, start, stop in zip(axes, starts, ends):
        extent = dims[axis]
        begin.append(_bound(c, start, extent))
        end.append(extent if isinstance(stop, int) and stop >= _INDEX_END else _bound(c, stop, extent))
    if isinstance(x, Known) and all(isinstance(v, int) for v in begin + end):
        index = [slice(None)] * len(dims)
        for axis, b, e, s in zip(axes, begin, end, steps):
            index[axis] = slice(b, e, s)
        return Known(x.values[tuple(index)], x.dtype)
    # The bounds are clamped above: in bounds, the result has a symbolic shape rather than an unknown one.
    return c.emit(relax.op.strided_slice(c.tensor(x), axes, begin, end, steps, assume_inbound=True))


def _bound(c: _Converter, index, extent):
    """A slice bound counted from the start and clamped to [0, extent]."""
    if isinstance(index, int) and index < 0:
        index = extent + index
    return c.simplify(tirx.max(tirx.min(index, extent), 0)) if isinstance(extent, tirx.Expr) or isinstance(
        index, tirx.Expr) else max(0, min(index, extent))


@_converter("Transpose")
def _transpose(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x = inputs[0]
    rank = len(c.shape_of(x))
    perm = list(attrs.get("perm", range(rank)[::-1]))
    if isinstance(x, Known):
        return Known(np.transpose(x.values, perm), x.dtype)
    return c.emit(relax.op.permute_dims(x, perm))


@_converter("Where")
def _where(c: _Converter, inputs: list[Value], _attrs: dict) -> Value:
    condition, x, y = inputs
    if all(isinstance(v, Known) for v in inputs) and not condition.symbolic:
        return Known(np.where(condition.values, x.values, y.values), x.dtype)
    return c.emit(relax.op.where(c.tensor(condition), c.tensor(x), c.tensor(y)))


@_converter("MatMul")
def _matmul(c: _Converter, inputs: list[Value], _attrs: dict) -> Value:
    return c.emit(relax.op.matmul(c.tensor(inputs[0]), c.tensor(inputs[1])))


@_converter("Gemm")
def _gemm(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    a, b = c.tensor(inputs[0]), c.tensor(inputs[1])
    if attrs.get("transA", 0):
        a = c.emit(relax.op.permute_dims(a, [1, 0]))
    if attrs.get("transB", 0):
        b = c.emit(relax.op.permute_dims(b, [1, 0]))
    out = c.emit(relax.op.matmul(a, b))
    dtype = str(out.ty.dtype)
    if attrs.get("alpha", 1.0) != 1.0:
        out = c.emit(relax.op.multiply(out, relax.const(attrs["alpha"], dtype)))
    if len(inputs) > 2 and inputs[2] is not None:
        bias = c.tensor(inputs[2])
        if attrs.get("beta", 1.0) != 1.0:
            bias = c.emit(relax.op.multiply(bias, relax.const(attrs["beta"], dtype)))
        out = c.emit(relax.op.add(out, bias))
    return out


@_converter("Softmax")
def _softmax(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    return c.emit(relax.op.nn.softmax(c.tensor(inputs[0]), axis=attrs.get("axis", -1)))


def _reduce(relax_func: Callable):
    def convert(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
        x = c.tensor(inputs[0])
        if len(inputs) > 1 and inputs[1] is not None:
            axes = c.ints(inputs[1], "the reduction's axes")
        else:
            axes = list(attrs.get("axes", []))
        if not axes and attrs.get("noop_with_empty_axes", 0):
            return x
        return c.emit(relax_func(x, axes or None, keepdims=bool(attrs.get("keepdims", 1))))
    return convert


_CONVERTERS.update({"ReduceMean": _reduce(relax.op.mean), "ReduceSum": _reduce(relax.op.sum),
                    "ReduceMax": _reduce(relax.op.max), "ReduceMin": _reduce(relax.op.min)})


@_converter("Split")
def _split(c: _Converter, inputs: list[Value], attrs: dict) -> list[Value]:
    x = c.tensor(inputs[0])
    dims = c.shape_of(x)
    axis = c.axis(attrs.get("axis", 0), len(dims))
    if len(inputs) > 1 and inputs[1] is not None:
        sizes = c.ints(inputs[1], "Split's sizes")
        indices = [sum(sizes[:i]) for i in range(1, len(sizes))]
    elif "split" in attrs:
        sizes = list(attrs["split"])
        indices = [sum(sizes[:i]) for i in range(1, len(sizes))]
    else:
        count = attrs.get("num_outputs")
        if count is None or not isinstance(dims[axis], int) or dims[axis] % count:
            raise c.error("Split into parts of unequal or unknown sizes is not converted")
        indices = count
    parts = c.emit(relax.op.split(x, indices, axis))
    return [c.emit(relax.TupleGetItem(parts, i)) for i in range(len(parts.ty.fields))]


@_converter("LayerNormalization")
def _layer_norm(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x = c.tensor(inputs[0])
    rank = len(x.ty.shape)
    axis = c.axis(attrs.get("axis", -1), rank)
    scale = c.tensor(inputs[1])
    bias = c.tensor(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else relax.const(
        np.zeros([int(d) for d in scale.ty.shape], str(scale.ty.dtype)))
    return c.emit(relax.op.nn.layer_norm(x, scale, bias, axes=list(range(axis, rank)),
                                         epsilon=attrs.get("epsilon", 1e-5)))


@_converter("Gelu")
def _gelu(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x = c.tensor(inputs[0])
    return c.emit(relax.op.nn.gelu_tanh(x) if attrs.get("approximate", "none") == "tanh" else relax.op.nn.gelu(x))


@_converter("CumSum")
def _cumsum(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    if attrs.get("reverse", 0):
        raise c.error("a reversed CumSum is not converted")
    x = c.tensor(inputs[0])
    axis = c.axis(c.ints(inputs[1], "CumSum's axis")[0], len(x.ty.shape))
    return c.emit(relax.op.cumsum(x, axis=axis, exclusive=bool(attrs.get("exclusive", 0))))


@_converter("Trilu")
def _trilu(c: _Converter, inputs: list[Value], attrs: dict) -> Value:
    x = c.tensor(inputs[0])
    k = c.ints(inputs[1], "Trilu's diagonal")[0] if len(inputs) > 1 and inputs[1] is not None else 0
    return c.emit(relax.op.triu(x, k) if attrs.get("upper", 1) else relax.op.tril(x, k))
