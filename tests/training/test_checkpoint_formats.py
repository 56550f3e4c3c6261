"""Every drafter checkpoint format, read and written: z-lab DFlash / DFlash2, speculators DFlash / DFlash2,
transformers' native DFlash.

* real speculators checkpoints (tests/fixtures/speculators/, made by bench/make_speculators_fixtures.py with
  speculators' own classes) load and reproduce the block states, logits and selector scores speculators computed;
* round trips through ``python -m dflash convert`` between every pair of formats are weight for weight identical,
  and a speculators checkpoint written from a z-lab one gives the same logits; speculators' own classes load
  what we write (tests/fixtures/speculators/ours_*) and compute our block states;
* detection by each format's own keys (no pair ambiguous), pairing checks, and errors naming the key.
"""

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash import DFlash2DraftModel, DFlashDraftModel, DraftConfigError
from dflash.decoding import check_pair
from dflash.drafter import convert, formats
from dflash.drafter.config import make_draft_config
from dflash.target.adapter import TargetAdapter
from tiny_models import tiny_target

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "speculators"
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


def state_of(model):
    return {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}


def randomized(model, seed):
    """``model`` with every weight random (DFlash2's convolutions start as the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def zlab_drafter(dflash2: bool, seed=3, target_layer_ids=(1, 3), **kw):
    config = make_draft_config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, vocab_size=300, num_target_layers=6, block_size=4,
                               mask_token_id=299, target_layer_ids=list(target_layer_ids),
                               max_position_embeddings=512, **(DFLASH2 if dflash2 else {}), **kw)
    return randomized((DFlash2DraftModel if dflash2 else DFlashDraftModel)(config), seed)


def check_drafter(dflash2: bool):
    """The z-lab drafter whose speculators-format save speculators itself loaded
    (tests/fixtures/speculators/ours_<kind>/, :func:`write_ours_fixtures`)."""
    config = make_draft_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, intermediate_size=64, vocab_size=300, num_target_layers=6, block_size=4,
                               mask_token_id=299, target_layer_ids=[1, 3], max_position_embeddings=512,
                               **({**DFLASH2, "conv_group_size": 8} if dflash2 else {}))
    return randomized((DFlash2DraftModel if dflash2 else DFlashDraftModel)(config), 11 + dflash2)


def write_ours_fixtures():
    """Write ``ours_dflash`` / ``ours_dflash2`` (our speculators-format writes); then
    bench/make_speculators_fixtures.py runs speculators on them."""
    for dflash2 in (False, True):
        check_drafter(dflash2).save_pretrained(FIXTURES / f"ours_{'dflash2' if dflash2 else 'dflash'}",
                                               format="speculators")


def block_pass(model, embed, ids, features, anchor):
    """The drafter's block states ``[B, H]`` at ``anchor``: context rows ``0..anchor-1``, block = the anchor token
    then masks."""
    B = model.block_size
    block = embed[torch.cat([ids[anchor:anchor + 1], torch.full((B - 1,), model.mask_token_id)])]
    with torch.no_grad():
        return model(block, features[:anchor], torch.arange(anchor + B))


# ------------------------------------------------------------------ speculators' own checkpoints


def speculators_pass(model, want):
    """Our block states ``[A*B, H]`` for a fixture's anchors (each block over the context rows before it)."""
    B = model.block_size
    with torch.no_grad():
        return torch.cat([model(want["block_embeds"][j * B:(j + 1) * B], want["features"][:a], torch.arange(a + B))
                          for j, a in enumerate(want["anchors"].tolist())])


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dflash_sliding", "dflash2_sliding"])
def test_speculators_checkpoint_reproduces_speculators_outputs(kind):
    ours = DFlashDraftModel.from_pretrained(str(FIXTURES / kind))
    assert isinstance(ours, DFlash2DraftModel) == kind.startswith("dflash2")
    if kind.endswith("_sliding"):  # [sliding (W 2), full]; dflash: causal sliding layer, dflash2: bidirectional
        assert [l.window_anchored for l in ours.layers] == [True, False] and ours.layers[0].sliding_window == 3
        assert [l.causal for l in ours.layers] == [kind == "dflash_sliding", False]
    assert ours.target_layer_ids == [1, 3]  # aux_hidden_state_layer_ids [2, 4]: the embedding output is 0
    assert ours.config.num_target_layers is None and ours.config.vocab_size == 300 and ours.mask_token_id == 299
    want = load_file(FIXTURES / f"{kind}_expected.safetensors")
    B = ours.block_size
    hidden = speculators_pass(ours, want)
    torch.testing.assert_close(hidden, want["hidden"], rtol=1e-5, atol=1e-5)
    logits = hidden @ want["lm_head"].T
    torch.testing.assert_close(logits, want["logits"], rtol=1e-5, atol=1e-4)
    if kind.startswith("dflash2"):
        k = ours.candidate_selector.top_k
        candidates = logits.topk(k, dim=-1).indices
        assert torch.equal(candidates, want["candidates"])
        with torch.no_grad():
            scores = ours.candidate_selector.score_candidates(logits.gather(-1, candidates), hidden,
                                                              want["predecessors"], candidates)
        torch.testing.assert_close(scores, want["scores"], rtol=1e-5, atol=1e-4)
    assert hidden.shape[0] == 3 * B


# ------------------------------------------------------------------ round trips


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One checkpoint of each of the five drafters: ``{name: (directory, format)}``."""
    root = tmp_path_factory.mktemp("sources")
    out = {"speculators-dflash": (FIXTURES / "dflash", "speculators"),
           "speculators-dflash2": (FIXTURES / "dflash2", "speculators")}
    for name, dflash2 in (("zlab-dflash", False), ("zlab-dflash2", True)):
        zlab_drafter(dflash2).save_pretrained(root / name)
        out[name] = (root / name, "zlab")
    zlab_drafter(False, seed=4).save_pretrained(root / "native-dflash", format="transformers")
    out["native-dflash"] = (root / "native-dflash", "transformers")
    return out


@pytest.mark.parametrize("name", ["zlab-dflash", "zlab-dflash2", "speculators-dflash", "speculators-dflash2",
                                  "native-dflash"])
def test_round_trips_between_every_format_are_identical(name, sources, tmp_path):
    src, src_fmt = sources[name]
    base = DFlashDraftModel.from_pretrained(str(src))
    dflash2 = isinstance(base, DFlash2DraftModel)
    extra = ["--num-target-layers", "6"]  # what the speculators format does not carry
    for fmt in formats.FORMATS:
        out = tmp_path / fmt
        if dflash2 and fmt == "transformers":
            assert convert.main([str(src), str(out), "--format", fmt] + extra) == 2
            continue
        assert convert.main([str(src), str(out), "--format", fmt] + extra) == 0
        assert formats.detect_format(json.load(open(out / "config.json"))) == fmt
        back = tmp_path / f"{fmt}-back"
        assert convert.main([str(out), str(back), "--format", src_fmt] + extra) == 0
        for directory in (out, back):
            other = DFlashDraftModel.from_pretrained(str(directory))
            assert type(other) is type(base)
            assert other.target_layer_ids == base.target_layer_ids and other.block_size == base.block_size
            assert other.mask_token_id == base.mask_token_id
            assert state_of(other).keys() == state_of(base).keys()
            assert all(torch.equal(state_of(other)[k], v) for k, v in state_of(base).items()), (fmt, directory)
        if src_fmt != "transformers":  # same stored names as the source, bit for bit
            a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_convert_dflash2_to_transformers_says_why(sources, tmp_path, capsys):
    assert convert.main([str(sources["zlab-dflash2"][0]), str(tmp_path / "x"), "--format", "transformers"]) == 2
    assert "transformers DFlash assistant format holds DFlash drafters only" in capsys.readouterr().err


@pytest.mark.parametrize("dflash2", [False, True])
def test_speculators_written_from_zlab_gives_the_same_logits(dflash2, sources, tmp_path):
    src = sources["zlab-dflash2" if dflash2 else "zlab-dflash"][0]
    assert convert.main([str(src), str(tmp_path), "--format", "speculators"]) == 0
    raw = json.load(open(tmp_path / "config.json"))
    assert raw["speculators_model_type"] == ("dflash2" if dflash2 else "dflash")
    assert raw["aux_hidden_state_layer_ids"] == [2, 4] and raw["block_size"] == 4 and raw["mask_token_id"] == 299
    assert raw["draft_vocab_size"] == raw["transformer_layer_config"]["vocab_size"] == 300
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "fc.weight" in names and not any(n.startswith(("embed_tokens", "lm_head", "verifier_")) for n in names)
    if dflash2:
        assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names
        assert raw["selector_top_k"] == 5 and "conv_kernel_size" not in raw["transformer_layer_config"]
    zlab, spec = DFlashDraftModel.from_pretrained(str(src)), DFlashDraftModel.from_pretrained(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    feats, ids = torch.randn(12, 128, generator=g), torch.randint(0, 299, (12,), generator=g)
    for anchor in (3, 8):
        a, b = (block_pass(m, embed, ids, feats, anchor) @ head.T for m in (zlab, spec))
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_speculators_loads_what_we_write(kind, tmp_path):
    """Our speculators-format write is the one speculators' own ``from_pretrained`` loaded (the committed copy)
    and its forward there gave our block states and logits."""
    check_drafter(kind == "dflash2").save_pretrained(tmp_path, format="speculators")
    committed = FIXTURES / f"ours_{kind}"
    raw, want_raw = (json.load(open(d / "config.json")) for d in (tmp_path, committed))
    assert raw == want_raw
    a, b = load_file(tmp_path / "model.safetensors"), load_file(committed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ours = DFlashDraftModel.from_pretrained(str(tmp_path))
    want = load_file(FIXTURES / f"ours_{kind}_expected.safetensors")
    hidden = speculators_pass(ours, want)
    torch.testing.assert_close(hidden, want["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden @ want["lm_head"].T, want["logits"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["dflash_sliding", "dflash2_sliding"])
def test_speculators_window_stays_in_speculators(kind, tmp_path, capsys):
    """Speculators' anchored window round-trips through its own format; z-lab and native windows are per row."""
    src = FIXTURES / kind
    for fmt in ("zlab", "transformers"):
        assert convert.main([str(src), str(tmp_path / fmt), "--format", fmt, "--num-target-layers", "6"]) == 2
        err = capsys.readouterr().err
        assert "window is per query row: write it in the speculators format" in err or (
            kind == "dflash2_sliding" and fmt == "transformers" and "DFlash drafters only" in err)
    assert convert.main([str(src), str(tmp_path / "s"), "--format", "speculators"]) == 0
    raw, back = json.load(open(src / "config.json")), json.load(open(tmp_path / "s" / "config.json"))
    assert back["sliding_window_non_causal"] == raw["sliding_window_non_causal"]
    layer, layer_back = raw["transformer_layer_config"], back["transformer_layer_config"]
    for key in ("layer_types", "sliding_window", "hidden_size", "num_hidden_layers", "rope_parameters"):
        assert layer_back[key] == layer[key], key
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "s" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    raw["dflash_config"] = {}
    json.dump(raw, open(tmp_path / "s" / "config.json", "w"))
    with pytest.raises(DraftConfigError, match="ambiguous"):
        DFlashDraftModel.from_pretrained(str(tmp_path / "s"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_anchored_window_mask_and_cached_rounds_agree(backend):
    """The anchored window in the cache-incremental pass (a decoding round; the Triton kernel under the
    interpreter) equals the full pass, and differs from the per-row window."""
    from dflash.drafter.cache import DraftKVCache
    from dflash_kernels import force_backend

    ours = DFlashDraftModel.from_pretrained(str(FIXTURES / "dflash_sliding"))
    g = torch.Generator().manual_seed(1)
    feats, block = torch.randn(9, 64, generator=g), torch.randn(4, 32, generator=g)
    cache = DraftKVCache(ours.config, 32, torch.float32, "cpu")
    with torch.no_grad():
        ours.ingest_context(feats[:6], cache)
        cache.freeze()
        waiting = torch.zeros(4, 64)
        waiting[:3] = feats[6:9]
        with force_backend(backend):
            cached = ours.draft_block(block, waiting, torch.tensor([3]), cache)
        full = ours(block, feats, torch.arange(13))
        torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
        ours.layers[0].window_anchored = False
        assert not torch.allclose(ours(block, feats, torch.arange(13)), full, atol=1e-4)


def test_zlab_dflash2_codebooks_are_written_as_published(sources):
    names = set(load_file(sources["zlab-dflash2"][0] / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in names
    assert "candidate_selector.predecessor_codebook.weight" not in names


# ------------------------------------------------------------------ detection


def test_each_format_is_detected_by_its_own_keys_only(sources):
    raws = {fmt: json.load(open(sources[name][0] / "config.json"))
            for name, fmt in (("zlab-dflash", "zlab"), ("native-dflash", "transformers"),
                              ("speculators-dflash", "speculators"))}
    for fmt, raw in raws.items():
        assert formats.detect_format(raw) == fmt
    shared = {"mask_token_id": 1, "block_size": 4, "target_layer_ids": [1], "architectures": ["DFlashDraftModel"]}
    with pytest.raises(DraftConfigError, match="not a DFlash drafter config of a known format"):
        formats.detect_format(shared)  # keys two formats share tell nothing
    for a, b in itertools.combinations(raws, 2):
        assert formats.detect_format({**raws[a], **shared}) == a
        with pytest.raises(DraftConfigError, match=f"ambiguous: it has the keys of the {a} and the {b} formats"):
            formats.detect_format({**raws[a], **raws[b]})
    for key in ("speculators_model_type", "transformer_layer_config"):
        assert formats.detect_format({key: raws["speculators"][key]}) == "speculators"


# ------------------------------------------------------------------ pairing


def test_native_drafter_is_checked_when_paired(tmp_path):
    draft = zlab_drafter(False)
    draft.save_pretrained(tmp_path, format="transformers")
    raw_native = json.load(open(tmp_path / "config.json"))
    for key in ("num_target_layers", "vocab_size"):  # as published
        raw_native.pop(key)
    json.dump(raw_native, open(tmp_path / "config.json", "w"))
    native = DFlashDraftModel.from_pretrained(str(tmp_path))
    assert native.config.num_target_layers is None and native.config.vocab_size is None

    def pair(target, drafter=native):
        with TargetAdapter(target) as adapter:
            check_pair(adapter, drafter)

    pair(tiny_target("qwen3", layers=6, vocab=300))  # hidden 64, vocab 300 fits
    with pytest.raises(DraftConfigError, match=r"ids \[3\] out of range for a target with 3 decoder layers"):
        pair(tiny_target("qwen3", layers=3, vocab=300))
    small = tiny_target("qwen3", layers=6, vocab=200)
    with pytest.raises(DraftConfigError, match="mask_token_id 299 is outside the target's vocabulary"):
        pair(small)
    with pytest.raises(DraftConfigError, match="vocab_size 300 != target vocabulary 200"):
        pair(small, draft)
    wide = make_draft_config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=64, vocab_size=300, num_target_layers=6, block_size=4,
                             mask_token_id=1, target_layer_ids=[1])
    with pytest.raises(DraftConfigError, match="drafter hidden_size 32 != target hidden size 64"):
        pair(tiny_target("qwen3", layers=6, vocab=300), DFlashDraftModel(wide))
    given = DFlashDraftModel.from_pretrained(str(tmp_path), target_config=tiny_target("qwen3", vocab=300).config)
    assert given.config.vocab_size == 300 and given.config.num_target_layers == 6
    with pytest.raises(DraftConfigError, match="mask_token_id 299 is outside the vocabulary"):
        DFlashDraftModel.from_pretrained(str(tmp_path), target_config=small.config)


# ------------------------------------------------------------------ z-lab keys


def _rewrite(directory, **changes):
    path = Path(directory) / "config.json"
    raw = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    json.dump(raw, open(path, "w"))
    return raw


def test_zlab_keys(tmp_path):
    draft = zlab_drafter(False)
    draft.save_pretrained(tmp_path)
    attrs = {"input_embedding_scale": "input_embedding_scale", "output_multiplier": "output_multiplier",
             "final_logit_softcapping": "logit_softcap"}
    for key, value in (("input_embedding_scale", 2.0), ("output_multiplier", 0.5), ("final_logit_softcapping", 30.0)):
        _rewrite(tmp_path, **{key: value})
        loaded = DFlashDraftModel.from_pretrained(str(tmp_path))
        assert getattr(loaded, attrs[key]) == value
        loaded.save_pretrained(tmp_path / "again")  # z-lab spells them: kept
        assert getattr(DFlashDraftModel.from_pretrained(str(tmp_path / "again")), attrs[key]) == value
        for fmt in ("speculators", "transformers"):  # no spelling there: refused, naming the key
            with pytest.raises(DraftConfigError, match=f"{key}={value}.*{fmt} format does not carry"):
                loaded.save_pretrained(tmp_path / fmt, format=fmt)
        _rewrite(tmp_path, **{key: None})
        _rewrite(tmp_path, dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3], key: value})
        assert getattr(DFlashDraftModel.from_pretrained(str(tmp_path)), attrs[key]) == value  # dflash_config first
        _rewrite(tmp_path, dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3]})
    for value in ("big", float("inf")):
        _rewrite(tmp_path, output_multiplier=value)
        with pytest.raises(DraftConfigError, match="output_multiplier=.*must be a finite number"):
            DFlashDraftModel.from_pretrained(str(tmp_path))
    _rewrite(tmp_path, output_multiplier=None, hidden_act="gelu")
    with pytest.raises(DraftConfigError, match="hidden_act 'gelu' is not supported"):
        DFlashDraftModel.from_pretrained(str(tmp_path))
    _rewrite(tmp_path, hidden_act=None)
    plain = DFlashDraftModel.from_pretrained(str(tmp_path))
    assert (plain.input_embedding_scale, plain.output_multiplier, plain.logit_softcap) == (None, 1.0, None)
    plain.save_pretrained(tmp_path / "spec", format="speculators")
    spec = json.load(open(tmp_path / "spec" / "config.json"))
    spec["transformer_layer_config"]["final_logit_softcapping"] = 30.0
    json.dump(spec, open(tmp_path / "spec" / "config.json", "w"))
    with pytest.raises(DraftConfigError, match="final_logit_softcapping=30.0.*speculators format does not carry"):
        DFlashDraftModel.from_pretrained(str(tmp_path / "spec"))
    raw = _rewrite(tmp_path, input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=0.0,
                   my_note="kept")
    assert DFlashDraftModel.from_pretrained(str(tmp_path)).config.my_note == "kept"
    # z-lab reads every DFlash key from dflash_config, then the top level; block_size defaults to 16
    inner = raw["dflash_config"]
    raw = _rewrite(tmp_path, dflash_config={"block_size": 6}, mask_token_id=inner["mask_token_id"],
                   target_layer_ids=[0, 2], block_size=None)
    moved = DFlashDraftModel.from_pretrained(str(tmp_path))
    assert (moved.block_size, moved.mask_token_id, moved.target_layer_ids) == (6, 299, [0, 2])
    moved.save_pretrained(tmp_path / "again")
    again = json.load(open(tmp_path / "again" / "config.json"))
    assert again["dflash_config"] == {"block_size": 6, "mask_token_id": 299, "target_layer_ids": [0, 2]}
    assert "block_size" not in again and "mask_token_id" not in again
    _rewrite(tmp_path, dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3]})
    assert DFlashDraftModel.from_pretrained(str(tmp_path)).block_size == 16
    _rewrite(tmp_path, dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3], "is_causal": True})
    assert all(layer.causal for layer in DFlashDraftModel.from_pretrained(str(tmp_path)).layers)


def test_zlab_needs_what_a_native_checkpoint_lacks(tmp_path, capsys):
    zlab_drafter(False).save_pretrained(tmp_path / "n", format="transformers")
    _rewrite(tmp_path / "n", num_target_layers=None, vocab_size=None)
    assert convert.main([str(tmp_path / "n"), str(tmp_path / "z"), "--format", "zlab"]) == 2
    assert "the z-lab format needs 'num_target_layers'" in capsys.readouterr().err
    assert convert.main([str(tmp_path / "n"), str(tmp_path / "z"), "--format", "zlab", "--num-target-layers", "6",
                         "--vocab-size", "300"]) == 0
    assert DFlashDraftModel.from_pretrained(str(tmp_path / "z")).config.vocab_size == 300


# ------------------------------------------------------------------ speculators errors


@pytest.mark.parametrize("change, match", [
    (dict(draft_vocab_size=100), "reduced draft vocabulary"),
    (dict(sample_from_anchor=True), "sample_from_anchor=true"),
    (dict(target_hidden_size=128), "target_hidden_size=128"),
    (dict(aux_hidden_state_layer_ids=[0, 2]), r"names the embedding output \(0\)"),
    (dict(speculators_model_type="eagle3"), "'eagle3' is not a DFlash drafter"),
    (dict(mask_token_id=None), "missing 'mask_token_id'"),
    (dict(gated_context=True), "does not implement: gated_context"),
])
def test_speculators_errors_name_the_key(tmp_path, change, match):
    raw = json.load(open(FIXTURES / "dflash" / "config.json"))
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    json.dump(raw, open(tmp_path / "config.json", "w"))
    save_file(load_file(FIXTURES / "dflash" / "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(DraftConfigError, match=match):
        DFlashDraftModel.from_pretrained(str(tmp_path))


def test_speculators_vocab_maps_and_sliding_layers_are_refused(tmp_path):
    state = load_file(FIXTURES / "dflash" / "model.safetensors")
    raw = json.load(open(FIXTURES / "dflash" / "config.json"))
    json.dump(raw, open(tmp_path / "config.json", "w"))
    save_file({**state, "d2t": torch.zeros(300, dtype=torch.long), "t2d": torch.ones(300, dtype=torch.bool)},
              tmp_path / "model.safetensors")
    with pytest.raises(DraftConfigError, match="reduced draft vocabulary"):
        DFlashDraftModel.from_pretrained(str(tmp_path))
    save_file({**state, "embed_tokens.weight": torch.zeros(300, 32)}, tmp_path / "model.safetensors")
    assert "embed_tokens.weight" not in state_of(DFlashDraftModel.from_pretrained(str(tmp_path)))  # skipped
    sliding = zlab_drafter(False, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    with pytest.raises(DraftConfigError, match="keep a window per query row .z-lab's rule.; speculators' window"):
        sliding.save_pretrained(tmp_path / "s", format="speculators")
    last = zlab_drafter(False, target_layer_ids=[1, 5])
    with pytest.raises(DraftConfigError, match=r"read the target's last layer \(5\)"):
        last.save_pretrained(tmp_path / "l", format="speculators")
