"""bench/'s hfjax side builds: every benchmark's imports of the project resolve, and the peer
benchmark's hfjax runner (bench/peers/run_hfjax.py, which writes every field of its specs by
hand) builds its actor, workers and step settings for the tiny workload. A spec that gains a
field, a module that moves or a function that is renamed breaks a benchmark here, in CI, not
the next time someone runs it (the peers' own virtual environments are not needed)."""

import ast
import importlib
import os
import pathlib
import sys

# The checkout itself (under Bazel this file is a link in the runfiles, which hold no bench/).
ROOT = pathlib.Path(os.path.realpath(__file__)).parent.parent
BENCH = ROOT / "bench"
FIRST_PARTY = ("hfjax", "launch", "configs")


def _scripts() -> list[pathlib.Path]:
    return sorted(p for p in BENCH.rglob("*.py") if ".venvs" not in p.parts)


def _top_level_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _unresolved(path: pathlib.Path) -> list[str]:
    """`path`'s imports of the project (anywhere in the file, functions included) that do not
    resolve: a missing module, or a name its module does not define. bench's own modules are
    read, not imported (each defines its absl flags at import)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            wanted = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in wanted:
            top = module.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if top == "bench":
                target = ROOT / (module.replace(".", "/") + ".py")
                if not target.is_file():
                    bad.append(f"{where} imports {module}: no such file")
                elif name and name not in _top_level_names(target):
                    bad.append(f"{where} imports {name} from {module}, which lacks it")
                continue
            if top not in FIRST_PARTY:
                continue
            try:
                mod = importlib.import_module(module)
            except ImportError as err:
                bad.append(f"{where} imports {module}: {err}")
                continue
            if name and not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    bad.append(f"{where} imports {name} from {module}, which lacks it")
    return bad


def test_every_benchmark_s_imports_of_the_project_resolve():
    scripts = _scripts()
    assert len(scripts) > 20 and BENCH / "peers" / "run_hfjax.py" in scripts
    bad = [b for p in scripts for b in _unresolved(p)]
    assert not bad, "\n".join(bad)


def test_an_import_of_a_missing_name_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    script = tmp_path / "bench" / "x.py"
    script.parent.mkdir()
    script.write_text("def f():\n    from hfjax.algorithms.spec import AlgoSpec, NoSuchSpec\n"
                      "from bench.y import z\n")
    (tmp_path / "bench" / "y.py").write_text("w = 1\n")
    bad = sorted(_unresolved(script))
    assert len(bad) == 2 and "NoSuchSpec" in bad[0] and "z from bench.y" in bad[1]


def test_the_peer_benchmark_s_hfjax_runner_builds_the_tiny_workload(tmp_path, monkeypatch):
    from hfjax.algorithms.spec import StepSpec
    from hfjax.workers.actor import ActorRollout

    monkeypatch.syspath_prepend(str(BENCH / "peers"))
    workload = importlib.import_module("workload")
    make_assets = importlib.import_module("make_assets")
    run_hfjax = importlib.import_module("run_hfjax")
    monkeypatch.setattr(workload, "OUT", str(tmp_path))
    w = workload.WORKLOADS["tiny"]
    os.makedirs(w.dir)
    make_assets.make_tiny(w)  # the seeded Qwen2 model, its tokenizer and the prompts

    actor, workers, spec, batch = run_hfjax.build(workload.get("tiny"))
    assert isinstance(actor, ActorRollout) and workers.actor is actor
    assert isinstance(spec, StepSpec)
    assert spec.algo.adv_estimator == "grpo" and spec.rollout.n == w.samples
    # A synchronous run: the rollout correction in force is off.
    assert spec.algo.rollout_correction.rollout_is not in ("auto", "token", "sequence")
    assert batch["prompts"].shape == (w.prompts, w.prompt_len)


def test_the_vision_bench_s_two_rollouts_have_the_same_prompt_length(monkeypatch):
    """bench/vision.py's prompts: one picture's placeholders (between the vision markers) in
    each image prompt, text tokens in their place in the text prompt, the same token count;
    the tower gives one feature per placeholder (the same over the batch's list and row by
    row), and both rollouts decode every row."""
    import numpy as np
    from flax import nnx

    from hfjax.engine import images as engine_images
    from hfjax.engine.sampler import Sampler
    from hfjax.engine.token_select import SamplingParams

    monkeypatch.syspath_prepend(str(ROOT))
    vision_model = importlib.import_module("bench.vision_model")
    model = vision_model.build(64, 1, 32, 1)
    with_images, text, pixels, grids = vision_model.prompts(2, 56, 3, np.random.default_rng(0))
    assert with_images.shape == text.shape == (2, 3 + 1 + 4 + 1 + 3)
    assert ((with_images == vision_model.IMAGE).sum(1) == 4).all()
    assert (with_images[:, 3] == vision_model.START).all()
    assert (with_images[:, 8] == vision_model.END).all()
    assert (text < vision_model.START).all()
    np.testing.assert_array_equal(np.delete(with_images, range(3, 9), 1),
                                  np.delete(text, range(3, 9), 1))
    encoded = engine_images.encode(model, pixels, grids)
    assert encoded.features.shape == (8, 64)
    # Row by row (the actor's rollout), the same features.
    from hfjax.workers.vision import tower_rows

    rows = tower_rows(model.visual, *vision_model.row_inputs(model, pixels, grids, 2))
    np.testing.assert_allclose(np.asarray(rows).reshape(8, 64), np.asarray(encoded.features),
                               rtol=1e-5, atol=1e-5)
    sampler = Sampler(model.lm, pad_id=0, max_prompt_len=text.shape[1], rules=None)
    sp = SamplingParams(max_new_tokens=4, n=2)
    mask = np.ones_like(text)
    state = nnx.state(model.lm)
    for ids, images in ((text, None), (with_images, encoded)):
        out = sampler.generate(state, ids, mask, sp, images=images)
        assert np.asarray(out.tokens).shape == (4, 4) and np.asarray(out.mask).all()
