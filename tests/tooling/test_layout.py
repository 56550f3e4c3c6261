"""The package layout: subpackages import only downward, and nothing imports in a cycle.

Layers of ``dflash`` from the bottom (docs/ARCHITECTURE.md): ``cache`` < ``drafter`` <
``target`` < ``decoding`` < ``tiny`` < ``training`` < ``benchmark`` < the package root,
``cli`` and ``__main__``. Every import of a ``dflash``
module, at module level or inside a function, is read from the source (AST) and must point to
the same layer or a lower one; inside a layer the module graph must be acyclic.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "dflash"
LAYERS = ["cache", "drafter", "target", "decoding", "tiny", "training", "benchmark", "<top>"]


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] not in LAYERS:
        return LAYERS.index("<top>")
    return LAYERS.index(parts[1])


def imports_of(path: pathlib.Path):
    """Absolute names of the dflash modules ``path`` imports (relative imports resolved)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "dflash" or target.startswith("dflash."):
                # `from . import x` names a submodule
                names = [f"{target}.{a.name}" for a in node.names]
                out.add(target)
                out.update(n for n in names if (ROOT.parent / n.replace(".", "/")).with_suffix(".py").exists()
                           or (ROOT.parent / n.replace(".", "/")).is_dir())
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name == "dflash" or a.name.startswith("dflash."))
    out.discard(me)
    return out


SOURCES = sorted(p for p in ROOT.rglob("*.py") if "assets" not in p.parts)


def test_every_module_sits_in_a_known_layer():
    top_level = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    allowed = set(LAYERS[:-1]) | {"__init__", "__main__", "cli", "assets", "__pycache__"}
    assert top_level <= allowed, f"modules outside the layer table: {sorted(top_level - allowed)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_only_point_down(path):
    me = module_name(path)
    mine = layer_of(me)
    upward = sorted(t for t in imports_of(path) if layer_of(t) > mine)
    assert not upward, f"{me} (layer {LAYERS[mine]}) imports higher layers: {upward}"


def test_no_import_cycle():
    graph = {module_name(p): {t for t in imports_of(p) if t != "dflash"} for p in SOURCES}
    # package __init__ modules re-export their children: an edge child -> package is the cycle we forbid
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_public_api_still_works():
    import dflash
    import dflash.decoding
    from dflash.decoding.compat import ddtree_generate, spec_generate
    from dflash.drafter import model as drafter_model

    assert callable(dflash.generate) and callable(dflash.apply) and callable(dflash.stream) and callable(ddtree_generate)
    # one drafter class: the network itself carries the reference-compatible method, no subclass patched from above
    assert dflash.DFlashDraftModel is drafter_model.DFlashDraftModel
    assert dflash.DFlash2DraftModel is drafter_model.DFlash2DraftModel
    assert issubclass(dflash.DFlash2DraftModel, dflash.DFlashDraftModel)
    assert not hasattr(dflash.DFlashDraftModel, "dflash2_class")
    assert callable(dflash.DFlashDraftModel.spec_generate)
    # its one seam to the loops above: the compat module, named, resolved when called
    assert drafter_model.generation_module().spec_generate is spec_generate
    assert dflash.GenerationResult.__module__ == "dflash.decoding.result"


USER_API = {"DFlash2DraftModel", "DFlashDraftModel", "DraftConfigError", "GenerationResult", "SamplingSettings",
            "TargetAdapter", "TargetStructureError", "UnsupportedGeneration", "apply", "default_target_layer_ids",
            "generate", "make_draft_config", "stream", "unapply", "warmup"}
DECODING_API = {"GenerationResult", "SamplingSettings", "UnsupportedGeneration", "apply", "check_pair", "generate",
                "is_applied", "stream", "unapply", "warmup"}
#: once public, now internal (their modules' own names) or in dflash.decoding.compat
REMOVED = {"Round", "LoopOptions", "GenerationPlan", "DropIn", "TokenStream", "METHODS", "resolve_generation",
           "ar_generate", "dflash_generate", "ddtree_generate", "ddtree_generate_result", "spec_generate",
           "prepare_generation", "run_generation", "generate_rounds", "DFlashDraftModel", "DFlash2DraftModel"}


#: each subpackage's __all__: what its users outside the package import from it
SUBPACKAGE_API = {
    "dflash.cache": {"CacheFullError", "KVBuffer"},
    "dflash.drafter": {"DFlash2DraftModel", "DFlashDraftModel", "DraftConfigError", "default_target_layer_ids",
                       "make_draft_config"},
    "dflash.target": {"ATTENTION_NAME", "PREFILL_CHUNK", "TargetAdapter", "TargetKVCache", "TargetStructureError",
                      "UnsupportedTargetFeature", "decoder_parts"},
    "dflash.decoding": DECODING_API,
    "dflash.tiny": {"load_tiny_drafter", "load_tiny_target", "load_tiny_tokenizer"},
    "dflash.training": set(),
    "dflash.benchmark": set(),
}


@pytest.mark.parametrize("package", sorted(SUBPACKAGE_API))
def test_subpackage_exports(package):
    import importlib

    module = importlib.import_module(package)
    assert set(module.__all__) == SUBPACKAGE_API[package]
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.__all__ names a missing {name}"


def test_public_surface_is_minimal():
    import dflash
    import dflash.decoding

    assert set(dflash.__all__) == USER_API
    assert set(dflash.decoding.__all__) == DECODING_API
    assert not REMOVED & set(dflash.decoding.__all__)
    for name in REMOVED:
        assert not hasattr(dflash.decoding, name), f"dflash.decoding.{name} is still exported"
    for package in (dflash, dflash.decoding):
        for name in package.__all__:
            assert hasattr(package, name), f"{package.__name__}.__all__ names a missing {name}"
