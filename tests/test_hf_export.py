"""`python -m train.export --format hf`: a directory `transformers` loads without custom code, as GPT-2 (``arch:
gpt2``) or Llama (``arch: llama``, here with grouped-query attention and an untied output projection), computing our
model's function. A real (short) CPU training run of each arch on the cc_net sample is exported through the CLI, then
loaded with AutoModelForCausalLM / AutoTokenizer and compared with our model on real text: logits at every position,
and greedy generation token for token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from train_fixtures import load_documents, tiny_overrides

from ground.formats import EOT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, FIM_TOKENS
from train.config import load_config
from train.export import load_final
from train.final import train_to_completion
from train.hf_export import HFExportError, check_expressible, to_gpt2
from train.model import GPT, GPTConfig
from train.parallel import DistContext
from train.preflight import check_data
from train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
REPO = Path(__file__).resolve().parents[1]


ARCHS = {
    "gpt2": ({}, "GPT2LMHeadModel"),
    "llama": ({"model.arch": "llama", "model.n_kv_head": 1, "model.tie_embeddings": False}, "LlamaForCausalLM"),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_export(
    request: pytest.FixtureRequest, token_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """(run dir, HF export dir) of a 30-step single-process run of each arch, exported through the CLI."""
    root = tmp_path_factory.mktemp(f"hf-{request.param}")
    torch.set_num_threads(1)
    arch = ARCHS[request.param][0]
    config = load_config(
        None, tiny_overrides(token_dir, root / "run", steps=30, **{"checkpoint.enabled": False}, **arch)
    )
    check_data(config)
    train_to_completion(Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu"))))
    out = root / "hf"
    result = subprocess.run(
        [sys.executable, "-m", "train.export", "--run", str(root / "run"), "--output", str(out), "--format", "hf"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return root / "run", out


def real_text_ids(tokenizer: Tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(load_documents()[3]).ids
    assert len(ids) >= length
    return ids[:length]


def test_transformers_loads_it_as_its_arch_without_custom_code(hf_export: tuple[Path, Path]) -> None:
    run, out = hf_export
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours, _ = load_final(run)
    assert type(model).__name__ == ARCHS[ours.config.arch][1]
    assert type(tokenizer).__name__ in {"PreTrainedTokenizerFast", "GPT2TokenizerFast", "TokenizersBackend"}
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.eos_token == EOT and tokenizer.eos_token_id == ours.token_to_id(EOT)
    text = load_documents()[0][:500]
    assert tokenizer(text)["input_ids"] == ours.encode(text).ids  # the same tokenizer, not a look-alike
    # The FIM sentinels are its special tokens too: a fill-in-the-middle prompt means what it meant in training.
    prompt = f"{FIM_PREFIX}def f(x):{FIM_SUFFIX} return y{FIM_MIDDLE}"
    assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == ours.encode(prompt, add_special_tokens=False).ids
    assert [ours.token_to_id(t) for t in FIM_TOKENS] == tokenizer.convert_tokens_to_ids(list(FIM_TOKENS))
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.token_to_id(EOT)
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["format"] == "hf" and lineage["step"] == 30 and lineage["run_dir"] == str(run.resolve())


def test_logits_equal_ours_at_every_position_on_real_text(hf_export: tuple[Path, Path]) -> None:
    run, out = hf_export
    ours, _ = load_final(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([real_text_ids(Tokenizer.from_file(str(out / "tokenizer.json")), ours.config.block_size)])
    with torch.no_grad():
        expected, _ = ours(ids)
        got = theirs(input_ids=ids).logits
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) <= 1e-5


def test_greedy_generation_matches_token_for_token(hf_export: tuple[Path, Path]) -> None:
    run, out = hf_export
    ours, _ = load_final(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = real_text_ids(Tokenizer.from_file(str(out / "tokenizer.json")), 8)
    new_tokens = ours.config.block_size - len(prompt)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):  # greedy with our model: argmax of the last position, appended
            logits, _ = ours(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        generated = theirs.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        )  # fmt: skip
    assert generated[0].tolist() == ids[0].tolist()


def test_the_exact_gelu_exports_as_gpt2s_exact_gelu() -> None:
    # model.activation: gelu (nanoGPT's nn.GELU()) becomes GPT2Config's "gelu", not the tanh form's "gelu_new". The
    # two GELUs differ by 5e-4 at most (near 2.7), so the MLP's weights are scaled up to put its inputs where they
    # differ: the same export with the tanh form is then 1e-4 away, the right one equal to float rounding.
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, activation="gelu")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name and name.endswith("weight"):
                param.mul_(5)
    ids = torch.randint(0, 64, (2, 16))
    hf = to_gpt2(model, eot_id=0)
    assert hf.config.activation_function == "gelu"
    with torch.no_grad():
        expected, _ = model(ids)
        assert float((hf(input_ids=ids).logits - expected).abs().max()) <= 1e-6
        hf.config.activation_function = "gelu_new"
        tanh = transformers.GPT2LMHeadModel(hf.config)
        tanh.load_state_dict(hf.state_dict())
        assert float((tanh.eval()(input_ids=ids).logits - expected).abs().max()) >= 1e-5


def test_a_model_gpt2_cannot_express_is_refused() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, bias=False))
    with pytest.raises(HFExportError, match="bias: false"):
        check_expressible(model)
    with pytest.raises(HFExportError, match="bias: false"):
        to_gpt2(model, eot_id=0)
