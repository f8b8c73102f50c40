"""HF-format weights in and out: safetensors directories (single or index-sharded) and GGUF files.

Loading streams tensors one at a time: each HF tensor is converted to hfjax's layout on the host
and put straight onto its target sharding, so no full copy of the model is assembled on one
device and the host holds at most one tensor. Stacked layer parameters are joined on device by
one jitted concatenation whose output already has the final sharding.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from hfjax.models import hf_names, moe, presets, transformer
from hfjax.models.config import ModelConfig
from hfjax.models.hf_names import EXPERT_PARAMS, converters, parse_hf_name, stacked_layers
from hfjax.parallel import sharding as shd
from hfjax.parallel.transfer import to_host


def _flat_params(state: nnx.State) -> dict[str, nnx.Variable]:
    out = {}
    for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=shd.is_variable)[0]:
        out[shd._path_name(path)] = var
    return out


def expected_hf_tensors(cfg: ModelConfig, head: str = "causal_lm") -> dict[str, tuple]:
    """HF tensor name -> HF shape that a checkpoint for `cfg` must provide."""
    abstract = transformer.abstract(cfg, head)
    conv = converters(cfg.model_type)
    out = {}
    for path, var in _flat_params(nnx.state(abstract)).items():
        tmpl, _, to_hf = conv[path]
        shape = var.get_value().shape
        layers = stacked_layers(cfg, path)
        one = shape[1:] if layers is not None else shape
        experts = range(one[0]) if path in EXPERT_PARAMS else [None]
        one = one[1:] if path in EXPERT_PARAMS else one
        spec = jax.ShapeDtypeStruct(one, jnp.float32)
        hf_shape = jax.eval_shape(functools.partial(to_hf, c=cfg), spec)
        for i in [None] if layers is None else layers:
            for e in experts:
                out[tmpl.format(i=i, e=e)] = tuple(hf_shape.shape)
    return out


def assemble(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    head: str = "causal_lm",
    mesh: Mesh | None = None,
    rules: str | dict = "train",
    optional: Iterable[str] = (),
    replicate_indivisible: Iterable[str] = ("kv_heads",),
) -> nnx.Module:
    """Builds a model from a stream of (HF name, HF-layout array), one tensor at a time.

    Each tensor is converted and placed on its target sharding immediately (the training layout
    of `mesh`, or the first device when mesh is None). Tensors in `optional` (our parameter
    paths) keep their fresh initialisation when absent. Raises ValueError naming the tensor on a
    missing tensor or a shape mismatch.
    """
    abstract = transformer.abstract(cfg, head)
    graphdef, abs_state = nnx.split(abstract)
    params = _flat_params(abs_state)
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("data",))
    lay = shd.layout(mesh, rules, replicate_indivisible=tuple(replicate_indivisible))
    dt = cfg.jnp_param_dtype
    conv = converters(cfg.model_type)
    pieces: dict[str, dict[int | None, jax.Array]] = {k: {} for k in params}
    # A layer's experts are gathered on the host (one projection of one layer at a time) and
    # placed together: our stack is [experts, ...] per layer, HF's is a tensor per expert.
    expert_rows: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    for name, w in tensors:
        parsed = parse_hf_name(name, cfg.model_type)
        if parsed is None:
            if not hf_names.IGNORED.match(name):
                logging.warning("ignoring tensor %s: hfjax has no parameter for it", name)
            continue
        ours, i, e = parsed
        if ours not in params:
            if ours == "lm_head" and cfg.tie_word_embeddings or head != "causal_lm":
                continue
            raise ValueError(f"tensor {name} does not belong to a {cfg.model_type} {head} model")
        if i is not None and i >= cfg.num_layers:
            raise ValueError(f"tensor {name}: layer {i} but the config has {cfg.num_layers}")
        if i is not None and i not in stacked_layers(cfg, ours):
            raise ValueError(f"tensor {name}: layer {i} is not a "
                             f"{moe.layer_kind(cfg, ours.split('.')[-1])} layer of this config "
                             "(mlp_only_layers / decoder_sparse_step)")
        var = params[ours]
        full = var.get_value().shape
        want = full[1:] if i is not None else full
        if e is not None:
            if e >= want[0]:
                raise ValueError(f"tensor {name}: expert {e} but the config has {want[0]}")
            want = want[1:]
        converted = conv[ours][1](np.asarray(w), cfg)
        if tuple(converted.shape) != tuple(want):
            hf_want = expected_hf_tensors(cfg, head).get(name)
            raise ValueError(
                f"tensor {name}: shape {tuple(np.shape(w))} does not match the config, "
                f"which expects {hf_want}"
            )
        axes = var.get_metadata()["logical_axes"]
        axes = axes[1:] if i is not None else axes
        if e is not None:
            rows = expert_rows.setdefault((ours, i), {})
            rows[e] = np.asarray(converted, dtype=dt)
            if len(rows) < full[1]:
                continue
            converted = np.stack([rows[j] for j in range(full[1])])
            want = full[1:]
            del expert_rows[(ours, i)]
        target = lay.sharding(axes, want, name)
        pieces[ours][i] = _place(np.asarray(converted, dtype=dt), target)
        del converted, w
    for (ours, i), rows in expert_rows.items():
        gap = next(j for j in range(params[ours].get_value().shape[1]) if j not in rows)
        raise ValueError(f"missing tensor {conv[ours][0].format(i=i, e=gap)}")

    optional = set(optional)
    values = {}
    for path, var in params.items():
        got = pieces[path]
        shape = var.get_value().shape
        layers = stacked_layers(cfg, path)
        stacked = layers is not None
        need = layers if stacked else [None]
        missing = [i for i in need if i not in got]
        if missing and path in optional and not got:
            values[path] = _fresh_head(cfg, head, var, lay)
            continue
        if missing:
            tmpl = conv[path][0]
            raise ValueError(
                f"missing tensor {tmpl.format(i=missing[0], e=0)} "
                f"({len(missing)} missing for parameter {path})"
            )
        axes = var.get_metadata()["logical_axes"]
        target = lay.sharding(axes, shape, path)
        if stacked:
            values[path] = _stack(tuple(got[i] for i in need), target)
        else:
            values[path] = got[None]
        pieces[path] = {}
    state = jax.tree.map_with_path(
        lambda p, v: v.replace(values[shd._path_name(p)]), abs_state, is_leaf=shd.is_variable
    )
    return nnx.merge(graphdef, state)


def _stack(arrays: tuple[jax.Array, ...], target: NamedSharding) -> jax.Array:
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=target)(*arrays)


def _fresh_head(cfg: ModelConfig, head: str, var: nnx.Variable, lay: shd.Layout) -> jax.Array:
    """A new scalar head: zeros for a critic (values start at 0), small normal for a scorer."""
    shape = var.get_value().shape
    if head == "value":
        w = np.zeros(shape, np.float32)
    else:
        w = 0.02 * np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    target = lay.sharding(var.get_metadata()["logical_axes"], shape, "score")
    return _place(np.asarray(w, dtype=cfg.jnp_param_dtype), target)


def _place(host: np.ndarray, target: NamedSharding) -> jax.Array:
    """`host`, which every process read alike, on `target`: each process uploads the shards of
    its own devices (jax.device_put refuses a host array onto a sharded layout that spans
    several processes, e.g. a pool over all of them)."""
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index],
                                        dtype=host.dtype)


# ----------------------------------------------------------------------------- safetensors


def _safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, x) for x in files]
    files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (and no index)")
    return [os.path.join(path, x) for x in files]


@contextlib.contextmanager
def _safe_open(fn: str):
    """`safetensors.safe_open` whose failures (a short, damaged or foreign file) are ValueErrors
    that say which file and whether it is truncated."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(fn, framework="np")
    except FileNotFoundError:
        raise FileNotFoundError(f"{fn}: no such file (listed by the model's index?)") from None
    except (SafetensorError, OSError) as err:
        text = str(err)
        what = ("is truncated" if "not fully covered" in text or "incomplete" in text
                else "is not a safetensors file (or is damaged)")
        raise ValueError(f"{fn} {what}: {text}; copy or convert the model again") from None
    with f:
        yield f


def _iter_safetensors(files: list[str], keep=None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every tensor of `files` whose name `keep` accepts (all when None),
    read one at a time."""
    for fn in files:
        with _safe_open(fn) as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def _check_safetensor_headers(files, cfg: ModelConfig, head: str, optional_hf: set[str]):
    """Validates names and shapes from the file headers before any tensor is read."""
    found = {}
    for fn in files:
        with _safe_open(fn) as f:
            for name in f.keys():
                found[name] = tuple(f.get_slice(name).get_shape())
    want = expected_hf_tensors(cfg, head)
    for name, shape in want.items():
        if name not in found:
            if name in optional_hf:
                continue
            raise ValueError(f"missing tensor {name} (expected shape {shape})")
        if found[name] != shape:
            raise ValueError(
                f"tensor {name}: shape {found[name]} does not match the config, "
                f"which expects {shape}"
            )


def _read_config(path: str) -> dict:
    fn = os.path.join(path, "config.json")
    if not os.path.exists(fn):
        raise FileNotFoundError(f"{path}: no config.json; is this an HF model directory?")
    with open(fn) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{fn} is not valid JSON ({err}); copy it again") from None


def head_of(hf_config: dict) -> str:
    """The head an HF config.json describes: "score" for a *ForSequenceClassification model
    (one scalar label), "causal_lm" otherwise. ValueError for a classifier with several labels,
    which a scalar score head cannot hold."""
    archs = hf_config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return "causal_lm"
    labels = hf_config.get("num_labels") or len(hf_config.get("id2label") or {}) or 1
    if int(labels) != 1:
        raise ValueError(f"{archs[0]} with {labels} labels: hfjax's score head reads one scalar "
                         "per sequence (a reward or cost model has num_labels=1)")
    return "score"


def load(
    path: str,
    *,
    mesh: Mesh | None = None,
    dtype: str = "float32",
    head: str | None = None,
    rules: str | dict = "train",
    replicate_indivisible: Iterable[str] = ("kv_heads",),
    require_head: bool = False,
    seed: int = 0,
    max_layers: int = 0,
    **config_overrides,
) -> nnx.Module:
    """Loads an HF directory, a `.gguf` file or a preset (`"preset:NAME"`) as an hfjax model.

    `head` None takes it from the checkpoint: a `LlamaForSequenceClassification` /
    `Qwen2ForSequenceClassification` directory (one label) loads as a `ScoreModel`, whose
    `model(ids, attention_mask=mask)` gives one score per row, read where transformers reads it
    (the last token that is not `pad_token_id`, `transformer.pooled_index`);
    anything else (a GGUF file, a preset) as a `CausalLM`. With a mesh, parameters are placed
    in the training layout (`rules`) of that mesh; without one, on the first device. `dtype`
    sets both the parameter and the compute dtype (give `param_dtype=` as well for, e.g.,
    bfloat16 compute over float32 weights). For the "value" and "score" heads, a causal-LM
    checkpoint provides the backbone and the head starts fresh when the checkpoint has none,
    unless `require_head` (then a missing `score.weight` is an error). Logical axes in
    `replicate_indivisible` are replicated, with a warning, where the mesh does not divide them
    (e.g. SmolLM2's 3 KV heads, or with ("kv_heads", "heads") its 9 query heads, on tensor=2);
    any other indivisible dimension is an error naming the tensor.

    A preset (hfjax.models.presets, e.g. "preset:qwen2.5-7b") has no weights: it is that
    architecture with random weights from `seed`, each parameter created directly in its
    sharding. `config_overrides` change any ModelConfig field of it or of a checkpoint's config.
    `max_layers` > 0 keeps at most a checkpoint's first `max_layers` decoder layers (a preset
    keeps its depth).
    """
    cfg = read_model_config(path, dtype=dtype, max_layers=max_layers, **config_overrides)
    keep = _in_first_layers(cfg) if max_layers else None
    if presets.preset_name(path) is not None:
        head = head or "causal_lm"
        if head != "causal_lm" and require_head:
            raise ValueError(f"{path}: a preset has random weights, not a trained {head} head")
        return build_sharded(cfg, head=head, mesh=mesh, rules=rules, seed=seed,
                             replicate_indivisible=replicate_indivisible)
    if str(path).endswith(".gguf"):
        from hfjax.models import gguf_io

        head = head or "causal_lm"
        if head != "causal_lm" and require_head:
            raise ValueError(f"{path}: a GGUF file holds a language model, not a {head} head")
        optional = ("score",) if head != "causal_lm" else ()
        tensors = gguf_io.iter_gguf_tensors(path, keep=keep)
    else:
        head = head or head_of(_read_config(path))
        optional = ("score",) if head != "causal_lm" and not require_head else ()
        files = _safetensor_files(path)
        _check_safetensor_headers(files, cfg, head, {"score.weight"} if optional else set())
        tensors = _iter_safetensors(files, keep=keep)
    return assemble(cfg, tensors, head=head, mesh=mesh, rules=rules, optional=optional,
                    replicate_indivisible=replicate_indivisible)


def read_model_config(path: str, *, dtype: str = "float32", max_layers: int = 0,
                      **config_overrides) -> ModelConfig:
    """The ModelConfig `load(path, dtype=..., max_layers=..., **config_overrides)` builds, read
    without loading any weight: a preset's, a `.gguf` file's header or an HF directory's
    config.json."""
    overrides = {"param_dtype": dtype, "dtype": dtype, **config_overrides}
    if (name := presets.preset_name(path)) is not None:
        return presets.get_preset(name).replace(**overrides)
    if str(path).endswith(".gguf"):
        from hfjax.models import gguf_io

        hf = gguf_io.read_gguf_config(path)
    elif not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory or a .gguf file")
    else:
        hf = _read_config(path)
    cfg = ModelConfig.from_hf_config(hf, **overrides)
    if 0 < max_layers < cfg.num_layers:
        cfg = cfg.replace(num_layers=max_layers, mlp_only_layers=tuple(
            i for i in cfg.mlp_only_layers if i < max_layers))
    return cfg


def _in_first_layers(cfg: ModelConfig):
    """Whether an HF tensor name belongs to a layer below `cfg.num_layers`, or to no layer (a
    checkpoint cut to its first layers, `load(max_layers=)`: the others are never read)."""
    def keep(name: str) -> bool:
        parsed = parse_hf_name(name, cfg.model_type)
        return parsed is None or parsed[1] is None or parsed[1] < cfg.num_layers
    return keep


def check_score_checkpoint(path: str, what: str = "path") -> None:
    """Raises ValueError unless `path` is an HF directory with a trained scalar score head
    (`score.weight`, one label), reading only config.json and the safetensors headers; `what`
    names the setting in the message (e.g. "reward_model.path")."""
    if not path:
        raise ValueError(f"{what} is empty; point it at a reward/cost model directory (one "
                         "that python -m launch.train_rm writes)")
    if str(path).endswith(".gguf") or not os.path.isdir(path):
        raise ValueError(f"{what}={path!r} is not an HF model directory; a reward or cost model "
                         "is a *ForSequenceClassification directory (python -m launch.train_rm "
                         "writes one)")
    hf = _read_config(path)
    head_of(hf)  # a multi-label classifier is refused here
    names = set()
    for fn in _safetensor_files(path):
        with _safe_open(fn) as f:
            names.update(f.keys())
    if "score.weight" not in names:
        archs = hf.get("architectures") or ["?"]
        raise ValueError(
            f"{what}={path!r} has no score head (no score.weight; the checkpoint is a "
            f"{archs[0]}): train one with python -m launch.train_rm, or point {what} at a "
            "*ForSequenceClassification checkpoint")


def load_score(path: str, *, what: str = "path", **kw) -> nnx.Module:
    """The ScoreModel of a reward or cost model directory, its trained head required
    (`check_score_checkpoint`); keyword arguments go to `load`."""
    check_score_checkpoint(path, what)
    return load(path, head="score", require_head=True, **kw)


def build_sharded(
    cfg: ModelConfig,
    *,
    head: str = "causal_lm",
    mesh: Mesh | None = None,
    rules: str | dict = "train",
    seed: int = 0,
    replicate_indivisible: Iterable[str] = ("kv_heads",),
) -> nnx.Module:
    """A freshly initialised model whose parameters are created in their shardings.

    Initialisation runs as one jitted program with the layout's shardings as outputs, so no
    device (and not the host) ever holds the whole model: an 8B preset on 8 devices allocates
    an eighth of it on each. The values are `transformer.build(cfg, head, seed)`'s (to float32
    rounding: the jitted initialiser fuses its scaling differently).
    """
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("data",))
    lay = shd.layout(mesh, rules, replicate_indivisible=tuple(replicate_indivisible))
    graphdef, abs_state = nnx.split(transformer.abstract(cfg, head))
    init = jax.jit(lambda: nnx.split(transformer.build(cfg, head, seed))[1],
                   out_shardings=lay.state_shardings(abs_state))
    return nnx.merge(graphdef, init())


def iter_hf_tensors(model: nnx.Module) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, HF-layout float array) for every parameter, one layer slice at a time.

    Parameters that span several processes are gathered slice by slice (`to_host`, a
    collective): every process of the run must iterate alike, and each gets every tensor.
    """
    cfg: ModelConfig = model.config
    conv = converters(cfg.model_type)
    for path, var in _flat_params(nnx.state(model, nnx.Param)).items():
        tmpl, _, to_hf = conv[path]
        arr = var.get_value()
        layers = stacked_layers(cfg, path)
        if layers is not None and path in EXPERT_PARAMS:
            for j, i in enumerate(layers):
                for e in range(arr.shape[1]):
                    yield tmpl.format(i=i, e=e), np.asarray(to_hf(to_host(arr[j, e]), cfg))
        elif layers is not None:
            for j, i in enumerate(layers):
                yield tmpl.format(i=i), np.asarray(to_hf(to_host(arr[j]), cfg))
        else:
            yield tmpl, np.asarray(to_hf(to_host(arr), cfg))


@contextlib.contextmanager
def written_in_place(path: str, prefix: str = ".tmp-hfjax-") -> Iterator[str]:
    """A new directory beside `path` to write into: when the block ends without an error it
    replaces `path` (an earlier one removed), and on an error it is removed, so a reader never
    sees a half-written directory."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def save_hf(
    model: nnx.Module,
    out_dir: str,
    tokenizer=None,
    *,
    max_shard_bytes: int = 2 * 1024**3,
) -> str:
    """Writes `model` as an HF directory (config.json, safetensors, tokenizer files).

    The directory is written under a temporary name and renamed into place, so a crash never
    leaves a half-written model. Shards larger than `max_shard_bytes` are split with an index.
    Across processes, every process must call it (the parameters are gathered with
    collectives) and process 0 alone writes. Returns out_dir.
    """
    from safetensors.numpy import save_file

    if jax.process_index() != 0:
        for _ in iter_hf_tensors(model):  # take part in the gathers; process 0 writes
            pass
        return out_dir
    cfg: ModelConfig = model.config
    with written_in_place(out_dir) as tmp:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name, w in iter_hf_tensors(model):
            if size and size + w.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = np.ascontiguousarray(w)
            size += w.nbytes
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, "model.safetensors"), {"format": "pt"})
        else:
            weight_map, total = {}, 0
            for k, shard in enumerate(shards):
                fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fn), {"format": "pt"})
                for name, w in shard.items():
                    weight_map[name] = fn
                    total += w.nbytes
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        hf = cfg.to_hf_config()
        if type(model).__name__ == "ScoreModel":
            # The family's sequence-classification class: one label, pooled at the last
            # non-padding token (which needs pad_token_id for batches).
            hf["architectures"] = [hf["architectures"][0].replace("ForCausalLM",
                                                                  "ForSequenceClassification")]
            hf["num_labels"] = 1
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        if tokenizer is not None:
            tokenizer.save(tmp)
    return out_dir

