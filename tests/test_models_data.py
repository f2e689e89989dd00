from pathlib import Path

import pytest
import torch
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_expand.app.data import (
    CharTokenizer,
    TextBatches,
    default_corpus_files,
    load_text,
    shard,
)
from spmd_expand.app.models import MLP, GPTConfig, build_gpt

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _ids(B: int = 2, T: int = 8) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))


def test_mlp_shape():
    model = MLP()
    assert model(torch.randn(3, 16)).shape == (3, 4)
    assert isinstance(model.act, torch.nn.ReLU)


def test_gpt_logits_shape_and_finite_loss():
    model = build_gpt(CONFIG)
    idx = _ids()
    assert model(idx).shape == (2, 8, CONFIG.vocab_size)
    loss = model(idx, _ids())
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_gpt_rejects_too_long_sequence():
    with pytest.raises(ValueError, match="block_size"):
        build_gpt(CONFIG)(_ids(T=CONFIG.block_size + 1))


def test_gpt_head_tied_to_token_embedding():
    model = build_gpt(CONFIG)
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names


def test_gpt_module_names_for_tp_plans():
    names = {n for n, _ in build_gpt(CONFIG).named_modules()}
    for suffix in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
        assert f"layers.1.{suffix}" in names


def test_build_gpt_deterministic_and_keeps_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a = build_gpt(CONFIG, seed=0).state_dict()
    assert torch.equal(torch.rand(1), expected)
    b = build_gpt(CONFIG, seed=0).state_dict()
    c = build_gpt(CONFIG, seed=1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])


def test_gpt_fwd_bwd_traces_with_fake_tensors():
    model = build_gpt(CONFIG)
    params = dict(model.named_parameters())

    def step(params, idx, targets):
        loss = functional_call(model, params, (idx, targets))
        return loss, torch.autograd.grad(loss, list(params.values()))

    gm = make_fx(step, tracing_mode="fake")(params, _ids(), _ids())
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("scaled_dot_product" in t for t in targets)
    loss, grads = gm(params, _ids(), _ids())
    assert torch.allclose(loss, model(_ids(), _ids()))
    assert [g.shape for g in grads] == [p.shape for p in params.values()]


def test_tokenizer_round_trip_and_unknown():
    text = "hello world\nthe quick brown fox!"
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert tok.decode(ids) == text
    assert tok.vocab_size == len(set(text)) + 1
    assert tok.encode("z")[0].item() == CharTokenizer.UNK_ID
    assert tok.decode(tok.encode("hz")) == "h" + CharTokenizer.UNK_CHAR


def test_tokenizer_cap_keeps_most_frequent_ties_by_code_point():
    tok = CharTokenizer("aaabbbccd", max_vocab_size=3)  # <unk> + 2 chars
    assert tok.vocab_size == 3
    assert tok.decode(tok.encode("abcd")) == "ab" + CharTokenizer.UNK_CHAR * 2


def test_text_batches_deterministic_and_shifted():
    ids = torch.arange(100)
    batches = TextBatches(ids, block_size=8, batch_size=4, seed=7)
    x, y = batches.batch(3)
    assert x.shape == y.shape == (4, 8)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # ids are consecutive, so the next character is id + 1
    x2, y2 = TextBatches(ids, block_size=8, batch_size=4, seed=7).batch(3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, batches.batch(4)[0])


def test_shard_concatenates_to_global_batch():
    x = torch.arange(24).view(6, 4)
    assert torch.equal(torch.cat([shard(x, r, 3) for r in range(3)]), x)
    assert torch.equal(shard(x, 1, 2, dim=1), x[:, 2:])
    with pytest.raises(ValueError, match="divisible"):
        shard(x, 0, 4)


def test_load_text_folder_sorted_skips_binary(tmp_path: Path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01")
    assert load_text(str(tmp_path)) == "first\nsecond\n"
    assert load_text(str(tmp_path), max_chars=3) == "fir"
    assert load_text(str(tmp_path / "b.txt")) == "second\n"


def test_load_text_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text"):
        load_text(str(tmp_path / "empty"))


def test_default_corpus():
    files = default_corpus_files()
    assert files and all(f.suffix == ".py" for f in files)
    root = Path(torch.__file__).parent
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    text = load_text(max_chars=10_000)
    assert len(text) == 10_000
