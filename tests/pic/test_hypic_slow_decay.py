"""HYPIC on a hybrid checkpoint whose linear-attention state decays slowly.

The tiny random hybrids forget within a token (their log-decay is about -softplus(1) per step), so a composed
tail's error never shows. Here every linear layer's ``A_log`` is set to -6 and ``dt_bias`` to 0: the state keeps
about 0.998 of itself per token, so what a cached tail's map got wrong carries to the end of the prompt.
Layer 0's inputs are the token embeddings, which do not depend on context, so its state must stay exact
whenever the seam covers the conv window; deeper linear layers show HYPIC's real (small) error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nebula_engine import LLM
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.model.tiny import make_tiny_checkpoint

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
SLOW_A_LOG, SLOW_DT_BIAS = -6.0, 0.0  # exp(-6) * softplus(~0) ~ 0.0017: per-token decay ~0.998
SHAPE = dict(system_len=8, num_docs=3, doc_len=40, question_len=6)


def pic_quality():
    if str(TOOLS_DIR) not in sys.path:
        sys.path.insert(0, str(TOOLS_DIR))
    import pic_quality as tool
    return tool


@pytest.fixture(scope="module")
def slow_decay_checkpoint(tmp_path_factory) -> str:
    path = make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("slow_decay"), seed=9)
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    edited = [name for name in weights if name.endswith(("A_log", "dt_bias"))]
    assert len(edited) == 4  # two linear-attention layers, two parameters each
    for name in edited:
        weights[name] = torch.full_like(weights[name], SLOW_A_LOG if name.endswith("A_log") else SLOW_DT_BIAS)
    save_file(weights, weights_file, metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def measure(slow_decay_checkpoint):
    tool = pic_quality()
    harness = tool.PICHarness(slow_decay_checkpoint, num_pages=256, page_size=8)
    prompts = [tool.RagPrompt.random(tool.PromptShape(**SHAPE), harness.vocab_range(), seed=s) for s in range(3)]

    def run(spec: str) -> dict:
        results = []
        for prompt in prompts:
            reference = tool.full_reference(harness, list(harness.segmented(prompt).token_ids), steps=4)
            try:
                results.append(tool.measure_backend(harness, spec, prompt, reference))
            finally:
                harness.release(reference.block_table)
        return tool.aggregate(spec, results)
    return run


def state_deviation(result: dict) -> dict[int, float]:
    return {row["layer"]: row["state"] for row in result["state_deviation"]}


@pytest.mark.parametrize("spec", ["hypic:seam=3", "hypic"])
def test_first_linear_layer_state_is_exact_at_any_valid_seam(measure, spec):
    deviation = state_deviation(measure(spec))
    assert deviation[0] < 1e-5, deviation


def test_slow_decay_shows_composed_tail_errors_and_the_exact_setting_has_none(measure):
    composed = measure("hypic:seam=3")
    assert state_deviation(composed)[2] > 1e-3  # the checkpoint can show HYPIC errors
    exact = measure("hypic:seam=1000000")
    assert max(state_deviation(exact).values()) < 1e-5 and exact["top1_agreement"] == 1.0


def test_default_seam_quality_on_slow_decay(measure, capsys):
    """Reports HYPIC's quality at its default seam (printed with ``-s``) and checks the seam helps."""
    narrow, default = measure("hypic:seam=3"), measure("hypic")
    with capsys.disabled():
        for result in (narrow, default):
            print(f"\n{result['backend']}: recomputed {result['num_recomputed']:.0f}/{result['num_reused']:.0f}, "
                  f"KL {result['kl_next']:.4f}, top-1 {result['top1_agreement']:.2f}, "
                  f"state deviation {state_deviation(result)}")
    assert default["num_recomputed"] > narrow["num_recomputed"]
    assert state_deviation(default)[2] < state_deviation(narrow)[2]


def test_seam_below_the_conv_window_is_refused(slow_decay_checkpoint):
    llm = LLM(slow_decay_checkpoint, page_size=8, num_pages=64, enable_prefix_caching=False, pic_backend="hypic")
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = {"segments": [("regular", [300, 301]), ("pic", list(range(400, 420))), ("regular", [302, 303])]}
    for seam in (1, 2):
        with pytest.raises(ValueError, match=r"seam=\d is below conv_kernel - 1 = 3"):
            llm.generate(prompt, greedy, pic_backend=f"hypic:seam={seam}")
    assert llm.generate(prompt, greedy, pic_backend="hypic:seam=3")[0].num_pic_cached_tokens == 20
    with pytest.raises(ValueError, match="below conv_kernel - 1"):
        LLM(slow_decay_checkpoint, page_size=8, num_pages=64, enable_prefix_caching=False, pic_backend="hypic:seam=2")
