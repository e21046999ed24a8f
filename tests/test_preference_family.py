"""ipo.py, simpo.py, orpo.py and kto.py, the preference family as diffs of dpo.py: each loss against numbers worked by
hand (the arithmetic is written beside each), its gradient against the derivative worked by hand, the boundary each
method is about (IPO's target margin, SimPO's gamma, ORPO's odds at equal probabilities, KTO's z0), the normaliser of
each script's sequence log-probs, its own flags refused in one line, and its diff budget against dpo.py.

Tolerances: the loss tests run in float64, where each value below is a handful of exp/log/sigmoid evaluations and sums
of at most four terms of size below 10: a few units of u64 = 1.1e-16 each, so 1e-12 leaves a margin of 1000 and still
fails any mistake of the formula (each mutation below moves a value by 1e-2 or more)."""

import math
import os
import subprocess

import pytest
import torch
from test_bad_input import refused

import common
import ipo
import kto
import orpo
import simpo
from helpers import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F64 = dict(dtype=torch.float64)
TOL = 1e-12  # float64: see the module docstring
NAME = lambda x: getattr(x, "__name__", str(x))  # test ids: the module's name


def f64(*values, grad=False):
    return torch.tensor(values, **F64, requires_grad=grad)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# ---------------------------------------------------------------------------------------------------------------------
# IPO (Azar et al. 2023, §5): (h - 1 / (2 tau))^2, tau = --beta, h the log-ratio difference
# ---------------------------------------------------------------------------------------------------------------------


def test_ipo_loss_and_gradient_against_hand_worked_numbers():
    """tau = 0.25: target 1 / (2 * 0.25) = 2. Pair 1: h = (-1 + 1.5) - (-3 + 2) = 0.5 + 1 = 1.5, loss (1.5 - 2)^2 = 0.25.
    Pair 2: h = (-2 + 2) - (-1 + 2) = -1, loss (-1 - 2)^2 = 9. Mean 4.625. d loss / d log pi(y_w) = 2 (h - 2) / 2 =
    -0.5 and -3; d / d log pi(y_l) = +0.5 and +3."""
    chosen, rejected = f64(-1.0, -2.0, grad=True), f64(-3.0, -1.0, grad=True)
    loss, m = ipo.compute_loss(chosen, rejected, f64(-1.5, -2.0), f64(-2.0, -2.0), ipo.Args(beta=0.25))
    loss.backward()
    # exactly: every number here is a sum of halves and their squares, exact in binary floating point
    assert loss.item() == 4.625
    assert m["rewards/margins"].tolist() == [1.5, -1.0] and m["rewards/accuracies"].tolist() == [1.0, 0.0]
    assert chosen.grad.tolist() == [-0.5, -3.0] and rejected.grad.tolist() == [0.5, 3.0]


def test_ipo_target_margin_is_a_minimum_not_a_direction():
    """tau = 0.5: target h = 1. At h = 1 the loss and its gradient are exactly 0; at h = 1.25 the gradient on log pi(y_w)
    is 2 * 0.25 = +0.5 (descent lowers h: IPO pulls an overshooting margin back), at h = 0.75 it is -0.5 (descent
    raises h). DPO's -log sigmoid(beta h) would push up at every h."""
    args = ipo.Args(beta=0.5)
    for h, loss_by_hand, grad_by_hand in ((1.0, 0.0, 0.0), (1.25, 0.0625, 0.5), (0.75, 0.0625, -0.5), (10.0, 81.0, 18.0)):
        chosen = f64(h, grad=True)  # log pi(y_w) - log pi_ref(y_w) = h, the rejected side's log-ratio 0
        loss, _ = ipo.compute_loss(chosen, f64(-2.0), f64(0.0), f64(-2.0), args)
        loss.backward()
        # exactly: quarters and their squares
        assert (loss.item(), chosen.grad.item()) == (loss_by_hand, grad_by_hand), h


# ---------------------------------------------------------------------------------------------------------------------
# SimPO (Meng et al. 2024, eq. 6): -log sigmoid(beta * mean log pi(y_w) - beta * mean log pi(y_l) - gamma)
# ---------------------------------------------------------------------------------------------------------------------


def test_simpo_loss_and_gradient_against_hand_worked_numbers():
    """beta = 2, gamma = 0.5, mean log-probs chosen (-0.5, -1.0), rejected (-1.0, -0.75): rewards (-1, -2) and (-2, -1.5),
    margins (1, -0.5), minus gamma (0.5, -1). Loss per pair log(1 + e^-0.5), log(1 + e^1). d / d chosen =
    -beta sigmoid(gamma - margin) / N = -sigmoid(-0.5), -sigmoid(1.0); d / d rejected the opposite."""
    chosen, rejected = f64(-0.5, -1.0, grad=True), f64(-1.0, -0.75, grad=True)
    loss, m = simpo.compute_loss(chosen, rejected, simpo.Args(beta=2.0, gamma=0.5))
    loss.backward()
    by_hand = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(1.0))) / 2
    assert loss.item() == pytest.approx(by_hand, abs=TOL)
    assert m["rewards/margins"].tolist() == [1.0, -0.5]  # exactly: halves times 2
    grads = [-2 * sigmoid(-0.5) / 2, -2 * sigmoid(1.0) / 2]
    assert chosen.grad.tolist() == pytest.approx(grads, abs=TOL)
    assert rejected.grad.tolist() == pytest.approx([-g for g in grads], abs=TOL)


def test_simpo_gamma_is_the_margin_to_win_by():
    """At a reward difference of 0 the loss is -log sigmoid(-gamma) = log(1 + e^gamma): with gamma = log 3, log 4, and
    the gradient on the chosen side -beta sigmoid(gamma) = -2 * 3/4 = -1.5 (gamma = 0 gives DPO's log 2 and -beta / 2).
    The loss falls to log 2 only when the chosen wins by gamma."""
    same = f64(-0.7)
    for gamma, loss_by_hand, grad_by_hand in ((math.log(3), math.log(4), -1.5), (0.0, math.log(2), -1.0)):
        chosen = f64(-0.7, grad=True)
        loss, _ = simpo.compute_loss(chosen, same, simpo.Args(beta=2.0, gamma=gamma))
        loss.backward()
        assert loss.item() == pytest.approx(loss_by_hand, abs=TOL), gamma
        assert chosen.grad.item() == pytest.approx(grad_by_hand, abs=TOL), gamma
    # chosen ahead by exactly gamma / beta in mean log-prob: reward difference gamma, the loss is -log sigmoid(0) = log 2
    loss, _ = simpo.compute_loss(f64(-0.7 + math.log(3) / 2), same, simpo.Args(beta=2.0, gamma=math.log(3)))
    assert loss.item() == pytest.approx(math.log(2), abs=TOL)


# ---------------------------------------------------------------------------------------------------------------------
# ORPO (Hong et al. 2024, eqs. 6-7): -mean log pi(y_w) + lambda * -log sigmoid(log odds(y_w) - log odds(y_l))
# ---------------------------------------------------------------------------------------------------------------------


def test_orpo_loss_and_gradient_against_hand_worked_numbers():
    """lambda = 0.1. Pair 1: P_w = 0.8 (odds 4), P_l = 0.5 (odds 1): log odds ratio log 4, L_OR = log(1 + 1/4) = log 1.25,
    L_SFT = -log 0.8. Pair 2: P_w = 0.25 (odds 1/3), P_l = 0.5: log odds ratio -log 3, L_OR = log(1 + 3) = log 4,
    L_SFT = log 4. Gradient: d log odds / d a = 1 / (1 - P), so d / d a_w = -1 - lambda sigmoid(-lor) / (1 - P_w) and
    d / d a_l = +lambda sigmoid(-lor) / (1 - P_l), halved by the mean: pair 1 sigmoid(-log 4) = 1/5, -1 - 0.1 * 0.2 * 5 =
    -1.1 and 0.1 * 0.2 * 2 = 0.04; pair 2 sigmoid(log 3) = 3/4, -1 - 0.1 * 0.75 * 4/3 = -1.1 and 0.1 * 0.75 * 2 = 0.15."""
    chosen = f64(math.log(0.8), math.log(0.25), grad=True)
    rejected = f64(math.log(0.5), math.log(0.5), grad=True)
    loss, m = orpo.compute_loss(chosen, rejected, orpo.Args(lam=0.1))
    loss.backward()
    by_hand = (-math.log(0.8) + 0.1 * math.log(1.25) + math.log(4) + 0.1 * math.log(4)) / 2
    assert loss.item() == pytest.approx(by_hand, abs=TOL)
    assert m["rewards/margins"].tolist() == pytest.approx([math.log(4), -math.log(3)], abs=TOL)
    assert chosen.grad.tolist() == pytest.approx([-0.55, -0.55], abs=TOL)
    assert rejected.grad.tolist() == pytest.approx([0.02, 0.075], abs=TOL)


def test_orpo_equal_probabilities_give_an_odds_ratio_of_one():
    """P_w = P_l: log odds ratio 0, L_OR = -log sigmoid(0) = log 2, whatever P; the loss is then -a + lambda log 2."""
    for p in (0.5, 0.9, 1e-3):
        a = f64(math.log(p))
        loss, m = orpo.compute_loss(a, a, orpo.Args(lam=0.25))
        assert m["loss/odds_ratio"].item() == pytest.approx(math.log(2), abs=TOL), p
        assert loss.item() == pytest.approx(-math.log(p) + 0.25 * math.log(2), abs=TOL), p


def test_orpo_stays_finite_where_the_probability_rounds_to_one():
    """A mean log-prob of exactly 0 (every token certain in float32) would make log(1 - P) = -inf: capped, the loss and
    its gradient stay finite."""
    chosen = torch.tensor([0.0, -1e-12], requires_grad=True)
    loss, _ = orpo.compute_loss(chosen, torch.tensor([-0.5, -0.5]), orpo.Args())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(chosen.grad).all()


# ---------------------------------------------------------------------------------------------------------------------
# KTO (Ethayarajh et al. 2024, §4): lambda_y - v(x, y) against the reference point z0
# ---------------------------------------------------------------------------------------------------------------------


def test_kto_reference_point_is_the_clamped_mean_log_ratio_and_carries_no_gradient():
    """Mismatched pairs' log-ratios (-1 + 1.5, -2 + 1.5, -0.5 + 1) = (0.5, -0.5, 0.5): z0 = 0.5 / 3 = 1/6. Log-ratios
    (-0.5, 0.25) average below 0: z0 = 0, the paper's max(0, .). Neither takes part in the backward pass."""
    kl_logps = f64(-1.0, -2.0, -0.5, grad=True)
    z0 = kto.compute_reference_point(kl_logps, f64(-1.5, -1.5, -1.0))
    assert z0.item() == pytest.approx(1 / 6, abs=TOL) and not z0.requires_grad
    assert kto.compute_reference_point(f64(-1.5, -1.0, grad=True), f64(-1.0, -1.25)).item() == 0.0
    logps = f64(-1.0, -2.0, grad=True)
    loss, _ = kto.compute_loss(logps, f64(-1.0, -2.0), torch.tensor([True, False]), z0, kto.Args())
    loss.backward()
    assert kl_logps.grad is None and logps.grad is not None


def test_kto_loss_and_gradient_against_hand_worked_numbers():
    """beta = 0.5, z0 = 0.25, lambda_D = 1, lambda_U = 2. Rewards r = (0.5, 0, 0.25, -1), the first two desirable.
    Desirable: 1 - sigmoid(0.5 (r - 0.25)) = 1 - sigmoid(0.125), 1 - sigmoid(-0.125). Undesirable:
    2 (1 - sigmoid(0.5 (0.25 - r))) = 2 (1 - sigmoid(0)) = 1 and 2 (1 - sigmoid(0.625)). Mean of 4. Gradient per example:
    -lambda_D beta s (1 - s) / 4 for a desirable one, +lambda_U beta s (1 - s) / 4 for an undesirable one, s the sigmoid."""
    logps = f64(-1.0, -2.0, -1.0, -3.0, grad=True)
    ref_logps = f64(-1.5, -2.0, -1.25, -2.0)
    desirable = torch.tensor([True, True, False, False])
    args = kto.Args(beta=0.5, lambda_d=1.0, lambda_u=2.0)
    loss, m = kto.compute_loss(logps, ref_logps, desirable, torch.tensor(0.25, **F64), args)
    loss.backward()
    s = [sigmoid(0.125), sigmoid(-0.125), sigmoid(0.0), sigmoid(0.625)]
    by_hand = [1 - s[0], 1 - s[1], 2 * (1 - s[2]), 2 * (1 - s[3])]
    assert m["loss/kto"].tolist() == pytest.approx(by_hand, abs=TOL)  # each example's own lambda_y
    assert loss.item() == pytest.approx(sum(by_hand) / 4, abs=TOL)
    weights = [-1.0, -1.0, 2.0, 2.0]  # -lambda_D for a desirable example, +lambda_U for an undesirable one
    assert logps.grad.tolist() == pytest.approx([w * 0.5 * x * (1 - x) / 4 for w, x in zip(weights, s)], abs=TOL)
    # exactly: halves and quarters. At r = z0 (the third) the example is on neither side: it counts as wrong
    assert m["rewards/desirable"].tolist() == [0.5, 0.0] and m["rewards/undesirable"].tolist() == [0.25, -1.0]
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_kto_z0_moves_the_boundary():
    """At r = z0 the value is lambda / 2 on either label, whatever z0, and the gradient is largest there
    (lambda beta / 4): a higher z0 makes the same desirable answer a loss and the same undesirable answer a gain."""
    args = kto.Args(beta=1.0)
    desirable, undesirable = torch.tensor([True]), torch.tensor([False])
    for z0 in (0.0, 0.3, 2.0):
        for label in (desirable, undesirable):
            logps = f64(z0 - 1.0, grad=True)  # r = z0
            loss, _ = kto.compute_loss(logps, f64(-1.0), label, torch.tensor(z0, **F64), args)
            loss.backward()
            assert loss.item() == pytest.approx(0.5, abs=TOL) and abs(logps.grad.item()) == pytest.approx(0.25, abs=TOL)
    r = f64(0.3)  # log pi - log pi_ref = 0.3
    desirable_loss = [kto.compute_loss(r, f64(0.0), desirable, torch.tensor(z, **F64), args)[0].item() for z in (0.0, 1.0)]
    undesirable_loss = [kto.compute_loss(r, f64(0.0), undesirable, torch.tensor(z, **F64), args)[0].item() for z in (0.0, 1.0)]
    assert desirable_loss[1] > desirable_loss[0] and undesirable_loss[1] < undesirable_loss[0]


# ---------------------------------------------------------------------------------------------------------------------
# Every script: its sequence log-probs, its flags, its diff against dpo.py
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module, mean", [(ipo, False), (simpo, True), (orpo, True), (kto, False)], ids=NAME)
def test_sequence_logps_are_sums_or_means_over_completion_tokens(module, mean):
    """IPO (the paper's choice) and KTO sum the completion's token log-probs as dpo.py does; SimPO's reward and ORPO's
    P(y) are per-token means."""
    model, input_ids, attention_mask, mask = tiny_model(batch=4)
    prompt_len = input_ids.shape[1] - mask.shape[1]
    got = module.sequence_logps(
        model, input_ids[:, :prompt_len], attention_mask[:, :prompt_len], input_ids[:, prompt_len:], mask
    )
    per_token, _ = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0)
    total = (per_token * mask).sum(dim=1)
    # float32, the same forward: only the <= 5 log-probs of size < 3 may be added in another order, < 5 u * 15 = 5e-6.
    # The rows hold 1 to 4 tokens, so a sum and a mean differ by a nat or more wherever there are 2 or more.
    assert torch.allclose(got, total / mask.sum(dim=1) if mean else total, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "module, flag, value, allowed",
    [
        (ipo, "beta", 0.0, "must be positive"),
        (simpo, "gamma", -0.5, "must be 0 (no target margin) or positive"),
        (simpo, "beta", float("nan"), "must be positive"),
        (orpo, "lam", -0.1, "must be positive"),
        (kto, "lambda_d", 0.0, "must be positive"),
        (kto, "lambda_u", float("inf"), "must be positive"),
        (kto, "batch_size", 0, "must be at least 1"),
    ],
    ids=NAME,
)
def test_each_script_refuses_its_own_flags_out_of_range(module, flag, value, allowed):
    refused(module, f"--{flag.replace('_', '-')} {value}: {allowed}", **{flag: value})


def test_a_labelled_file_with_a_label_that_is_not_true_or_false_is_refused(tmp_path):
    import preference_pairs

    data = tmp_path / "labelled.jsonl"
    data.write_text(
        '{"prompt": "1+1=", "completion": "2", "label": true}\n{"prompt": "1+2=", "completion": "4", "label": "no"}\n'
    )
    with pytest.raises(SystemExit) as info:
        preference_pairs.load_labelled(str(data))
    assert str(info.value.code) == f"--dataset {str(data)!r}: a label is 'no'; labels must be true or false (or 1 or 0)"


@pytest.mark.parametrize("script, budget", [("ipo.py", 52), ("simpo.py", 95), ("orpo.py", 92), ("kto.py", 203)])
def test_diff_budget_against_dpo(script, budget):
    """A sibling changes dpo.py only where its method differs: lines starting with < or > in `diff dpo.py X`."""
    out = subprocess.run(["diff", "dpo.py", script], cwd=ROOT, capture_output=True, text=True).stdout
    changed = sum(line.startswith(("<", ">")) for line in out.splitlines())
    assert 0 < changed <= budget, f"{script}: {changed} changed lines, budget {budget}"
