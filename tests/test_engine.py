"""grpo_engine.py: the importance-sampling correction by exact enumeration over a tiny policy, its weights and metrics
against numbers worked by hand, the staleness bookkeeping of a run, the weights sent to the built-in engine (each dtype,
LoRA merged) and the log-probs it samples with. vLLM itself: tests/test_vllm_engine.py."""

import math

import pytest
import torch
from test_siblings import ENUMERATION_ATOL, RESPONSES, REWARDS, THETA, response_logprobs
from test_smoke import SMALL, coin_flip_rewards, rows, run_here

import common
import engines
import grpo
import grpo_engine
import sft
from plumbing import models

# The engine's policy mu: THETA moved by a fixed amount, so that mu and pi_old (THETA) disagree on every response by up
# to a factor of about 2.5 (the ratios pi_old / mu of the seven responses run from 0.45 to 2.5).
THETA_ENGINE = THETA + torch.tensor([[0.4, -0.5, 0.3], [-0.6, 0.3, 0.2], [0.5, -0.4, -0.3]], dtype=torch.float64)


def probability(theta, response) -> torch.Tensor:
    logprobs, _ = response_logprobs(theta, response)  # (1, 2), 0 where the response has ended
    return logprobs.sum().exp()


def engine_loss(args):
    """grpo_engine's loss of one response with its reward as advantage: weights from pi_old's and mu's log-probs."""

    def loss(logprobs, engine_logprobs, mask, reward):
        weights, _ = grpo_engine.compute_correction(logprobs.detach(), engine_logprobs, mask, args)
        return grpo_engine.compute_loss(logprobs, logprobs.detach(), None, reward[None], mask, args, None, weights)[0]

    return loss


def grpo_loss(logprobs, engine_logprobs, mask, reward):
    """grpo.py's loss of the same response, which knows nothing of the engine."""
    return grpo.compute_loss(logprobs, logprobs.detach(), None, reward[None], mask, grpo.Args(beta=0.0))[0]


def expected_gradient(loss_of, sampler, weight_of=lambda response: 1.0):
    """sum over the seven responses y of P_sampler(y) weight_of(y) (-grad loss_of(y)) at theta = THETA = pi_old, each
    response's reward its advantage, the engine's log-probs those of THETA_ENGINE."""
    theta = THETA.clone().requires_grad_(True)
    total = torch.zeros_like(THETA)
    for response, reward in zip(RESPONSES, REWARDS):
        logprobs, mask = response_logprobs(theta, response)
        engine_logprobs, _ = response_logprobs(THETA_ENGINE, response)
        (grad,) = torch.autograd.grad(loss_of(logprobs, engine_logprobs, mask, reward), theta)
        total -= probability(sampler, response) * weight_of(response) * grad
    return total


def sequence_ratio(response) -> float:
    return (probability(THETA, response) / probability(THETA_ENGINE, response)).item()


def test_the_ratios_of_the_enumerated_policies_are_far_from_1():
    """The setting of the tests below: mu and pi_old differ enough that a cap of 1.5 or a band of [0.7, 1.3] changes
    some responses and not others."""
    ratios = [sequence_ratio(r) for r in RESPONSES]
    assert min(ratios) < 0.7 and max(ratios) > 1.5 and any(0.7 <= r <= 1.3 for r in ratios)


def test_sampled_by_the_engine_without_a_correction_the_gradient_is_not_the_on_policy_one():
    """The bias the correction removes: E_mu[grad] of grpo.py's loss is not E_pi_old[grad]."""
    off_policy = expected_gradient(engine_loss(grpo_engine.Args(beta=0.0, correction="none")), THETA_ENGINE)
    on_policy = expected_gradient(grpo_loss, THETA)
    assert (off_policy - on_policy).abs().max() > 0.01


def test_sequence_weights_with_no_cap_give_exactly_the_on_policy_expected_gradient():
    """E_mu[W(y) grad L(y)] = sum_y mu(y) pi_old(y) / mu(y) grad L(y) = E_pi_old[grad L(y)], W = prod_t rho_t."""
    args = grpo_engine.Args(beta=0.0, correction="tis", correction_level="sequence", correction_cap=math.inf)
    assert torch.allclose(
        expected_gradient(engine_loss(args), THETA_ENGINE), expected_gradient(grpo_loss, THETA), rtol=0, atol=ENUMERATION_ATOL
    )


def test_truncated_sequence_weights_give_the_on_policy_gradient_down_weighted_where_the_engine_under_samples():
    """TIS at C: E_mu[min(W, C) grad L] = sum_y min(pi_old(y), C mu(y)) grad L = E_pi_old[min(1, C / W(y)) grad L]."""
    cap = 1.5
    args = grpo_engine.Args(beta=0.0, correction="tis", correction_level="sequence", correction_cap=cap)
    expected = expected_gradient(grpo_loss, THETA, lambda y: min(1.0, cap / sequence_ratio(y)))
    assert torch.allclose(expected_gradient(engine_loss(args), THETA_ENGINE), expected, rtol=0, atol=ENUMERATION_ATOL)


def test_masked_sequence_weights_give_the_on_policy_gradient_of_the_responses_inside_the_band():
    """MIS on [C_low, C]: E_mu[1{C_low <= W <= C} W grad L] = E_pi_old[1{C_low <= W(y) <= C} grad L]."""
    low, cap = 0.7, 1.3
    args = grpo_engine.Args(
        beta=0.0, correction="mis", correction_level="sequence", correction_cap=cap, correction_cap_low=low
    )
    expected = expected_gradient(grpo_loss, THETA, lambda y: float(low <= sequence_ratio(y) <= cap))
    assert torch.allclose(expected_gradient(engine_loss(args), THETA_ENGINE), expected, rtol=0, atol=ENUMERATION_ATOL)


def test_token_weights_correct_each_token_given_its_prefix_but_not_the_rest_of_the_response():
    """Per-token ratios with no cap correct the sampled token's distribution given its prefix, but the prefix and the
    continuation (which sets the reward and the length of the response) are still drawn from mu: the expected gradient
    misses the on-policy one, by less than no correction does here."""
    args = grpo_engine.Args(beta=0.0, correction="tis", correction_level="token", correction_cap=math.inf)
    on_policy = expected_gradient(grpo_loss, THETA)
    token = expected_gradient(engine_loss(args), THETA_ENGINE)
    uncorrected = expected_gradient(engine_loss(grpo_engine.Args(beta=0.0, correction="none")), THETA_ENGINE)
    assert (token - on_policy).abs().max() > 1e-3
    assert (token - on_policy).norm() < (uncorrected - on_policy).norm()


def test_no_weight_corrects_the_group_statistics_of_the_engine_s_samples():
    """GRPO's advantage is standardised within a group drawn from mu: its mean and std are mu's. With groups of 2 and
    per-sequence weights of no cap, the expected gradient over every ordered pair of responses still differs from the
    on-policy one (it equals it only with the advantage held fixed, above)."""
    import itertools

    args = grpo_engine.Args(beta=0.0, correction="tis", correction_level="sequence", correction_cap=math.inf)

    def expected(sampler, engine):
        theta = THETA.clone().requires_grad_(True)
        total = torch.zeros_like(THETA)
        for pair in itertools.product(range(len(RESPONSES)), repeat=2):
            logprobs, mask = map(torch.cat, zip(*(response_logprobs(theta, RESPONSES[i]) for i in pair)))
            engine_logprobs = torch.cat([response_logprobs(THETA_ENGINE, RESPONSES[i])[0] for i in pair])
            advantages = grpo_engine.compute_advantages(REWARDS[list(pair)], 2)
            if engine:
                weights, _ = grpo_engine.compute_correction(logprobs.detach(), engine_logprobs, mask, args)
                loss, _ = grpo_engine.compute_loss(logprobs, logprobs.detach(), None, advantages, mask, args, None, weights)
            else:
                loss, _ = grpo.compute_loss(logprobs, logprobs.detach(), None, advantages, mask, grpo.Args(beta=0.0))
            (grad,) = torch.autograd.grad(loss, theta)
            total -= math.prod(probability(sampler, RESPONSES[i]).item() for i in pair) * grad
        return total

    assert (expected(THETA_ENGINE, engine=True) - expected(THETA, engine=False)).abs().max() > 1e-3


def test_the_kl_penalty_is_weighted_like_the_surrogate():
    """With no advantage the loss is beta times the weighted k3 alone: weights of c scale grpo.py's loss by c, and a
    response masked to 0 drops out of the mean over responses (its length and count stay)."""
    torch.manual_seed(0)
    logprobs, ref = torch.randn(4, 3), torch.randn(4, 3)
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True, True, True]])
    args, zero = grpo_engine.Args(beta=0.04), torch.zeros(4)
    ours = lambda w: grpo_engine.compute_loss(logprobs, logprobs, ref, zero, mask, args, None, w)[0]
    theirs = lambda rows: grpo.compute_loss(logprobs[rows], logprobs[rows], ref[rows], zero[rows], mask[rows], args)[0]
    # float32: a scaled sum of 9 terms below 10, the order of the operations changed (a few ulps of 1)
    assert ours(torch.full((4, 3), 0.5)).item() == pytest.approx(0.5 * theirs(slice(None)).item(), rel=1e-6)
    dropped = torch.ones(4, 3)
    dropped[1] = 0.0
    assert ours(dropped).item() == pytest.approx(3 / 4 * theirs([0, 2, 3]).item(), rel=1e-6)


@pytest.mark.parametrize("correction, level", [("tis", "token"), ("mis", "sequence"), ("none", "token")])
def test_when_the_engine_agrees_with_the_trainer_the_loss_is_grpo_s_exactly(correction, level):
    """Equal log-probs give ratios of exactly 1 and weights of exactly 1: the same loss and gradient as grpo.py."""
    torch.manual_seed(0)
    logits = torch.randn(6, 5, 7, requires_grad=True)
    targets = torch.randint(0, 7, (6, 5))
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)  # (6, 5)
    mask = torch.arange(5)[None] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]
    advantages, old = torch.randn(6), logprobs.detach() + 0.1 * torch.randn(6, 5)
    args = grpo_engine.Args(beta=0.0, correction=correction, correction_level=level)
    weights, _ = grpo_engine.compute_correction(old, old.clone(), mask, args)
    assert torch.equal(weights, mask.float())
    ours, _ = grpo_engine.compute_loss(logprobs, old, None, advantages, mask, args, None, weights)
    theirs, _ = grpo.compute_loss(logprobs, old, None, advantages, mask, grpo.Args(beta=0.0))
    assert torch.equal(ours, theirs)
    ours_gradient = torch.autograd.grad(ours, logits, retain_graph=True)[0]
    assert torch.equal(ours_gradient, torch.autograd.grad(theirs, logits)[0])


# Two responses of two tokens, the second of one token (padding after it). Row 0: log rho = (0.5, -0.2), so
# rho = (e^0.5, e^-0.2) = (1.6487, 0.8187) and W = e^0.3 = 1.3499; row 1: rho = W = 1.
OLD = torch.tensor([[-1.0, -2.0], [-0.1, 0.0]])
ENGINE = torch.tensor([[-1.5, -1.8], [-0.1, -7.0]])
MASK = torch.tensor([[True, True], [True, False]])
E = math.exp


@pytest.mark.parametrize(
    "correction, level, cap, low, weights, changed_tokens, changed_responses",
    [
        ("tis", "token", 1.5, 0.0, [[1.5, E(-0.2)], [1.0, 0.0]], 1 / 3, 1 / 2),
        ("mis", "token", 1.5, 0.0, [[0.0, E(-0.2)], [1.0, 0.0]], 1 / 3, 1 / 2),
        ("mis", "token", 1.5, 0.9, [[0.0, 0.0], [1.0, 0.0]], 2 / 3, 1 / 2),
        ("tis", "sequence", 1.5, 0.0, [[E(0.3), E(0.3)], [1.0, 0.0]], 0.0, 0.0),
        ("tis", "sequence", 1.2, 0.0, [[1.2, 1.2], [1.0, 0.0]], 2 / 3, 1 / 2),
        ("mis", "sequence", 1.2, 0.0, [[0.0, 0.0], [1.0, 0.0]], 2 / 3, 1 / 2),
        ("mis", "sequence", 3.0, 0.5, [[E(0.3), E(0.3)], [1.0, 0.0]], 0.0, 0.0),
        ("none", "token", 2.0, 0.0, [[1.0, 1.0], [1.0, 0.0]], None, None),
    ],
)
def test_correction_weights_and_shares_against_numbers_worked_by_hand(
    correction, level, cap, low, weights, changed_tokens, changed_responses
):
    args = grpo_engine.Args(correction=correction, correction_level=level, correction_cap=cap, correction_cap_low=low)
    got, metrics = grpo_engine.compute_correction(OLD, ENGINE, MASK, args)
    # float32 exp of numbers below 1 in size: a relative error of a few ulps, 1e-6 is far above it
    assert torch.allclose(got, torch.tensor(weights), rtol=0, atol=1e-6)
    assert torch.allclose(
        metrics["rollout/logprob_gap"], torch.tensor([0.5, 0.2, 0.0], dtype=torch.float64), rtol=0, atol=1e-6
    )
    k3 = [E(0.5) - 1 - 0.5, E(-0.2) - 1 + 0.2, 0.0]  # rho - 1 - log rho, KL(mu || pi_old) of each token's sample
    assert torch.allclose(metrics["kl/engine"], torch.tensor(k3, dtype=torch.float64), rtol=0, atol=1e-6)
    name = {"tis": "train/is_truncated", "mis": "train/is_masked"}.get(correction)
    if name is None:
        assert not any(k.startswith(("train/is_truncated", "train/is_masked")) for k in metrics)
    else:
        assert metrics[f"{name}_frac"].mean().item() == pytest.approx(changed_tokens)
        assert metrics[f"{name}_seq_frac"].mean().item() == pytest.approx(changed_responses)


def test_a_ratio_that_underflows_to_0_below_the_lower_cap_counts_as_masked():
    """MIS with C_low = 0.5: a response whose log-ratios add up to -200 has W = e^-200 = 0 in float32, below the band:
    its weight is 0 and it counts as masked (before the fix, a weight equal to its ratio, 0 = 0, counted as kept)."""
    old = torch.full((2, 2), -1.0)
    engine = torch.tensor([[99.0, 99.0], [-1.0, -1.0]])  # (not real log-probs: only their difference matters here)
    args = grpo_engine.Args(correction="mis", correction_level="sequence", correction_cap=2.0, correction_cap_low=0.5)
    weights, metrics = grpo_engine.compute_correction(old, engine, torch.ones(2, 2, dtype=torch.bool), args)
    assert weights.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert metrics["train/is_masked_frac"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert metrics["train/is_masked_seq_frac"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_a_sequence_ratio_that_overflows_gives_finite_weights_gradients_and_metrics(correction):
    """A long response whose log-ratios add up to 200 has W = e^200 = inf in float32: TIS truncates it to C, MIS masks
    it, neither the loss nor its gradient holds a NaN (padding included), and every logged statistic is finite: the
    log-ratio (200 on each of its tokens) instead of the ratio, KL(mu || pi_old) per token in float64."""
    old = torch.full((2, 4), -1.0)
    engine = torch.tensor([[-51.0, -51.0, -51.0, -51.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    args = grpo_engine.Args(correction=correction, correction_level="sequence", correction_cap=2.0, beta=0.0)
    weights, metrics = grpo_engine.compute_correction(old, engine, mask, args)
    assert torch.equal(weights[0], torch.full((4,), 2.0 if correction == "tis" else 0.0))
    assert all(torch.isfinite(v).all() for v in metrics.values())
    assert metrics["train/is_log_ratio"].tolist() == [200.0] * 4 + [0.0] * 2
    assert metrics["kl/engine"][0].item() == pytest.approx(math.exp(50) - 51, rel=1e-12)  # one token's gap of 50 nats
    logprobs = old.clone().requires_grad_(True)
    loss, _ = grpo_engine.compute_loss(logprobs, old, None, torch.tensor([1.0, -1.0]), mask, args, None, weights)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


# --- the run: staleness, versions, syncs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, staleness, versions",
    [
        ([], [0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]),
        (["--max-staleness", "2"], [0, 1, 2, 2, 2, 2], [0, 0, 0, 1, 2, 3]),
        (["--sync-every", "2", "--max-staleness", "1"], [0, 1, 0, 1, 0, 1], [0, 0, 2, 2, 4, 4]),
        (["--sync-every", "3", "--max-staleness", "3"], [0, 1, 2, 3, 1, 2], [0, 0, 0, 0, 3, 3]),
    ],
)
def test_each_rollout_comes_from_the_weights_the_schedule_says(monkeypatch, model_dir, tmp_path, flags, staleness, versions):
    """The engine samples max_staleness - sync_every + 1 batches ahead and takes the trainer's weights after every
    --sync-every updates: the logged version of each step's rollout, and its staleness (updates between the engine's
    weights and pi_old), follow. In float32 the engine's log-probs are the trainer's where the weights are the same (a
    gap of float32 rounding) and far from them where they are older (lr 1e-2 moves them; the test model answers nothing
    right, so seeded coin flips give the groups something to learn)."""
    coin_flip_rewards(monkeypatch)
    small = [*SMALL[:1], "6", *SMALL[2:]]  # SMALL's --total-steps 2, as 6
    run_here(
        monkeypatch,
        "grpo_engine.py",
        *["--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *small, "--eval-every", "10"],
        *["--engine-dtype", "float32", "--learning-rate", "1e-2", "--num-minibatches", "1", *flags],
    )
    logged = rows(tmp_path)[1:]
    assert [r["rollout/staleness"] for r in logged] == staleness
    assert [r["rollout/engine_version"] for r in logged] == versions
    for row, stale in zip(logged, staleness):
        # the same weights: the KV-cached loop and one pass sum in other orders, a few float32 ulps of logits below 10
        assert (row["rollout/logprob_gap_max"] < 1e-4) == (stale == 0), row


@pytest.mark.parametrize("num_minibatches, policy_passes", [(1, 0), (2, 2)])
def test_on_policy_the_old_log_probs_come_from_the_update_s_own_pass(
    monkeypatch, model_dir, tmp_path, num_minibatches, policy_passes
):
    """One minibatch and one epoch: the policy is still pi_old when the loss is computed, so no separate no-grad pass
    of the policy runs (grpo.py's saving); with two minibatches the second is taken after an optimizer step, and pi_old
    needs its own pass, once per step. Either way the correction is computed and logged (the schedule test above checks
    its values against the engine's)."""
    passes = []
    logprobs_no_grad = common.logprobs_no_grad
    monkeypatch.setattr(common, "logprobs_no_grad", lambda model, *a: passes.append(model) or logprobs_no_grad(model, *a))
    flags = ["--num-minibatches", str(num_minibatches), "--beta", "0"]
    run_here(monkeypatch, "grpo_engine.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL, *flags)
    assert len(passes) == policy_passes  # SMALL: 2 steps
    assert all("train/is_log_ratio" in row and "rollout/logprob_gap_max" in row for row in rows(tmp_path)[1:])


def test_the_engine_s_state_is_gathered_only_for_a_checkpoint(monkeypatch, model_dir, tmp_path):
    """--save-every 2 over 4 steps: the engine's part of the checkpoint (its weights between syncs, the batches sampled
    ahead, gathered across processes under torchrun) is built twice, at steps 2 and 4, not at every step."""
    built = []
    checkpoint_extra = engines.checkpoint_extra
    monkeypatch.setattr(engines, "checkpoint_extra", lambda *a: built.append(a[3]) or checkpoint_extra(*a))
    small = [*SMALL[:1], "4", *SMALL[2:], "--save-every", "2", "--max-staleness", "1"]
    run_here(monkeypatch, "grpo_engine.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *small)
    assert built == [2, 4]


def test_the_default_run_corrects_per_token_with_a_cap_of_2_and_logs_the_mismatch(monkeypatch, model_dir, tmp_path):
    """The default engine is a bf16 copy: its log-probs differ from the float32 trainer's by rounding, never by 0."""
    run_here(monkeypatch, "grpo_engine.py", "--model-name-or-path", model_dir, "--output-dir", str(tmp_path), *SMALL)
    row = rows(tmp_path)[-1]
    assert 0 < row["rollout/logprob_gap"] < row["rollout/logprob_gap_max"] < 1.0
    assert row["train/is_log_ratio_min"] < 0 < row["train/is_log_ratio_max"]
    assert "train/is_truncated_frac" in row and "train/is_masked_frac" not in row


# --- the weights the engine gets, and the log-probs it samples with ----------------------------------------------------


def perturbed(model):
    """The trainer after some training: every weight moved by seeded noise."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def sampling_gap(engine, trainer, tokenizer, temperature=0.7):
    """|log pi_trainer - log pi_engine| of each token the engine samples for 32 prompts (8 distinct, 4 each)."""
    prompts = [f"{a:02d}+{b:02d}=" for a, b in zip(range(10, 90, 10), range(13, 99, 11)) for _ in range(4)]
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, torch.device("cpu"))
    completion_ids, mask, _, engine_logprobs = engine.generate(prompt_ids, prompt_mask, 6, temperature)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    logprobs = common.logprobs_no_grad(trainer, input_ids, attention_mask, completion_ids.shape[1], temperature, 32)
    return (logprobs - engine_logprobs)[mask].abs()


# Tolerances of the engine's log-probs against the float32 trainer's, per token (mean, max). float32: the same weights,
# summed in another order (the KV-cached loop against one pass): dot products of 128 to 384 terms at u = 6e-8 on logits
# below 10, about 1e-5 at most. bfloat16 and float16 round every weight and activation to 8 and 11 significant bits
# (u = 2^-9, 2^-12): through 4 layers and the output layer a logit of size 10 moves by a few times 10 u, about 0.05
# (bf16) and 0.006 (fp16), and a log-prob by at most twice its largest logit's move (log softmax is 2-Lipschitz in the
# max norm); the mean gap is a fraction of that. Measured on the test model (Intel Xeon, AMX): means 4e-7, 0.008 and
# 0.001, maxima 2e-6, 0.04 and 0.005.
TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (0.03, 0.25), "float16": (0.005, 0.04)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_after_a_sync_the_engine_samples_with_the_trainer_s_log_probs_to_its_dtype(model_dir, dtype):
    tokenizer = models.load_tokenizer(model_dir, "")
    trainer = perturbed(models.load_model(model_dir, "", torch.device("cpu")))
    engine = engines.BuiltinEngine(
        models.load_model(model_dir, "", torch.device("cpu"), dtype=engines.DTYPES[dtype]), tokenizer
    )
    mean_tolerance, max_tolerance = TOLERANCES[dtype]
    assert sampling_gap(engine, trainer, tokenizer).mean() > 4 * max_tolerance  # before: the weights of the warm-up
    engine.load_weights(engines.trainer_weights(trainer))
    assert next(engine.model.parameters()).dtype == engines.DTYPES[dtype]  # rounded to the engine's dtype, not replaced
    gap = sampling_gap(engine, trainer, tokenizer)
    assert gap.mean() < mean_tolerance and gap.max() < max_tolerance, (gap.mean(), gap.max())


def test_the_engine_gets_the_lora_adapter_merged_into_the_weights(model_dir):
    """With --lora-rank the engine holds W + (alpha / r) B A: in float32 it samples with the adapted trainer's log-probs."""
    pytest.importorskip("peft")
    from plumbing import lora

    tokenizer = models.load_tokenizer(model_dir, "")
    trainer = lora.add_adapter(models.load_model(model_dir, "", torch.device("cpu")), grpo_engine.Args(lora_rank=4))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name:  # B = 0 at the start: give the adapter an effect
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
    engine = engines.BuiltinEngine(models.load_model(model_dir, "", torch.device("cpu")), tokenizer)
    assert sampling_gap(engine, trainer, tokenizer).mean() > 1e-2  # the base alone is not the adapted model
    engine.load_weights(engines.trainer_weights(trainer))
    assert sampling_gap(engine, trainer, tokenizer).max() < TOLERANCES["float32"][1]
    assert not any("lora_" in name for name in engines.trainer_weights(trainer))


@pytest.mark.parametrize("rho, bf16_base_share", [(1e-4, (0.0, 0.15)), (1e-3, (0.35, 0.75)), (1e-2, (0.97, 1.03))])
def test_a_bf16_engine_keeps_little_of_a_small_update_merged_into_a_bf16_base(model_dir, rho, bf16_base_share):
    """The merged weight W + delta, rounded to bf16 for the engine: on a bf16 base W every |delta| under half a bf16
    step of W (2^-9 |W| to 2^-8 |W|) rounds back to W; on a float32 base, W is off bf16's grid and the rounding keeps
    delta on average. The share of the update that reaches the engine, <applied, delta> / <delta, delta>, for an
    adapter whose delta has entries of size rho |W| on average (seeded): near 0, about a half, and all of it at
    rho = 1e-4, 1e-3, 1e-2 on the bf16 base (measured: 6.5%, 57%, 99.9%); all of it on the float32 base (99.4-100.8%:
    the noise of 65,536 entries rounded at random places)."""
    pytest.importorskip("peft")
    from plumbing import lora

    for base_dtype, (low, high) in ((torch.bfloat16, bf16_base_share), (torch.float32, (0.97, 1.03))):
        model = models.load_model(model_dir, "", torch.device("cpu"), dtype=base_dtype)
        trainer = lora.add_adapter(model, grpo_engine.Args(lora_rank=4, lora_target_modules="q_proj"))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for module in trainer.modules():
                if hasattr(module, "lora_B") and "default" in module.lora_B:
                    module.lora_B["default"].weight.copy_(
                        torch.randn(module.lora_B["default"].weight.shape, generator=generator)
                    )
                    delta = module.get_delta_weight("default").float()
                    scale = rho * module.get_base_layer().weight.float().abs().mean() / delta.abs().mean()
                    module.lora_B["default"].weight.mul_(scale)
        merged = engines.trainer_weights(trainer)
        share = []
        for name, module in trainer.named_modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                w = module.get_base_layer().weight.float()
                delta, applied = module.get_delta_weight("default").float(), merged[f"{name}.weight"].bfloat16().float()
                share.append(((applied - w.bfloat16().float()) * delta).sum() / (delta * delta).sum())
        assert low < torch.stack(share).mean().item() < high, (base_dtype, share)


@pytest.mark.parametrize("base, engine_dtype, warned", [("bfloat16", "bfloat16", True), ("float32", "bfloat16", False)])
def test_a_lora_run_on_a_bf16_base_with_a_bf16_engine_is_warned_in_one_line(model_dir, capsys, base, engine_dtype, warned):
    pytest.importorskip("peft")
    from plumbing import lora

    args = grpo_engine.Args(model_name_or_path=model_dir, lora_rank=4, lora_base_dtype=base, engine_dtype=engine_dtype)
    cpu = torch.device("cpu")
    policy = lora.add_adapter(models.load_model(model_dir, "", cpu, dtype=lora.base_dtype(args, cpu)), args)
    engines.make_engine(args, policy, models.load_tokenizer(model_dir, ""), ["1+1="], cpu)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --lora-rank")]
    assert len(lines) == int(warned)


def test_the_engine_samples_greedily_with_a_log_prob_of_0_and_pads_with_0():
    torch.manual_seed(0)
    tokenizer = sft.build_tokenizer()
    engine = engines.BuiltinEngine(sft.build_tiny_model(tokenizer), tokenizer)
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["1+2=", "13+45="], torch.device("cpu"))
    _, mask, _, logprobs = engine.generate(prompt_ids, prompt_mask, 5, 0.0)
    assert torch.equal(logprobs, torch.zeros_like(logprobs))
    _, mask, _, logprobs = engine.generate(prompt_ids, prompt_mask, 5, 1.0)
    assert (logprobs[mask] < 0).all() and torch.equal(logprobs[~mask], torch.zeros_like(logprobs[~mask]))


def test_a_vllm_servers_unfinished_or_malformed_answer_stops_the_run_in_one_line(monkeypatch):
    """The server's answers are checked: a response cut short by another client's /pause (finish_reason "abort"), or an
    answer without token ids and log-probs, stops the run in one line; after a failed request the requests still queued
    fail at once instead of waiting for the server (a canned answer stands in for the server: what a real one returns
    is tested in test_vllm_engine.py)."""
    engine = engines.VLLMServerEngine.__new__(engines.VLLMServerEngine)
    engine.url, engine.model, engine.eos_ids, engine.failed = "http://server:1", "m", [2], ""
    choice = {"index": 0, "finish_reason": "abort", "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}}
    monkeypatch.setattr(engine, "call", lambda *a: {"choices": [choice]})
    with pytest.raises(SystemExit, match=r"did not finish the responses: \['abort'\]"):
        engine.sample([1, 2], 1, 0, 4, 1.0)
    monkeypatch.setattr(engine, "call", lambda *a: {"choices": [{"index": 0, "finish_reason": "stop"}]})
    with pytest.raises(SystemExit, match="answered /v1/completions without token ids and log-probs"):
        engine.sample([1, 2], 1, 0, 4, 1.0)
    monkeypatch.undo()
    engine.failed = "the vLLM server at http://server:1 failed on POST /v1/completions: reset (start it again, then --resume)"
    with pytest.raises(SystemExit, match="failed on POST /v1/completions: reset"):
        engine.call("POST", "/v1/completions", {})  # no request is sent: the first failure is repeated
