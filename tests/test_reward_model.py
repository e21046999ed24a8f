"""reward_model.py against the Bradley-Terry model (InstructGPT eq. 1), the pair split, the reward model's scoring, and
--reward-model in the RL scripts."""

import copy
import json
import os

import datasets
import pytest
import torch
from test_smoke import SMALL, rows, run_here
from transformers import LlamaForSequenceClassification

import common
import preference_pairs
import reward_model
import tasks
from helpers import tiny_model
from plumbing import models


def args(**overrides):
    return reward_model.Args(**{"center_coef": 0.0, **overrides})


def test_bradley_terry_loss_and_gradient_against_worked_numbers():
    """Margins R_w - R_l of 1, 0 and -2: -log sigmoid(1) = log(1 + e^-1) = 0.313262, -log sigmoid(0) = log 2 = 0.693147,
    -log sigmoid(-2) = log(1 + e^2) = 2.126928. The gradient of the mean with respect to R_w is -sigmoid(-margin) / 3:
    sigmoid(-1) = 0.268941, sigmoid(0) = 0.5, sigmoid(2) = 0.880797; with respect to R_l it is the opposite."""
    chosen = torch.tensor([1.0, 0.5, -1.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    loss, metrics = reward_model.compute_loss(chosen, rejected, args())
    # float64 (error ~1e-16) against numbers printed to 6 decimals, each off by at most 5e-7, and so is their mean
    assert loss.item() == pytest.approx((0.313262 + 0.693147 + 2.126928) / 3, abs=5e-7)
    loss.backward()
    expected = torch.tensor([-0.268941, -0.5, -0.880797], dtype=torch.float64) / 3
    atol = 5e-7 / 3  # printed to 6 decimals, then divided by 3
    assert torch.allclose(chosen.grad, expected, rtol=0, atol=atol)
    assert torch.allclose(rejected.grad, -expected, rtol=0, atol=atol)
    assert metrics["train/pairwise_accuracy"].tolist() == [1.0, 0.0, 0.0]  # a tie is not a win
    assert metrics["train/margin"].tolist() == [1.0, 0.0, -2.0]


def test_a_constant_added_to_both_rewards_changes_only_the_centring_term():
    """The pairs identify R only up to a constant per prompt: the Bradley-Terry term ignores it, and the centring term
    center_coef * mean((R_w + R_l)^2) is what pins it: 0.1 * ((1 - 1)^2 + (3 + 1)^2) / 2 = 0.8 for the pairs below."""
    f64 = dict(dtype=torch.float64)
    chosen, rejected = torch.tensor([1.0, 3.0], **f64), torch.tensor([-1.0, 1.0], **f64)
    shifts = torch.tensor([5.0, -2.5], **f64)  # a different constant for each prompt
    plain, _ = reward_model.compute_loss(chosen, rejected, args())
    shifted, _ = reward_model.compute_loss(chosen + shifts, rejected + shifts, args())
    # float64: sums, squares and log-sigmoids of values < 10, a few u64 * 100 = 1e-14 at most
    assert shifted.item() == pytest.approx(plain.item(), abs=1e-12)
    centred, metrics = reward_model.compute_loss(chosen, rejected, args(center_coef=0.1))
    assert centred.item() == pytest.approx(plain.item() + 0.8, abs=1e-12)
    assert metrics["loss/centring"].mean().item() == pytest.approx(0.8, abs=1e-12)
    shifted_centred = reward_model.compute_loss(chosen + 1, rejected + 1, args(center_coef=0.1))[0].item()
    assert shifted_centred != pytest.approx(centred.item(), abs=1e-12)  # the centring term moves by 1.2


def test_pair_split_keeps_each_problem_on_one_side():
    """Built-in pairs are split by the unordered operands, so that "07+45=" is never trained on when "45+07=" is held
    out; a user's pairs, by prompt (two rows with one prompt stay together)."""
    problems = [(a, b) for a in range(0, 60, 3) for b in range(1, 60, 7)]
    prompts = [f"{a:02d}+{b:02d}=" for a, b in problems] + [f"{b:02d}+{a:02d}=" for a, b in problems[::2]]
    pairs = datasets.Dataset.from_dict({"prompt": prompts, "chosen": ["1"] * len(prompts), "rejected": ["2"] * len(prompts)})
    train, held_out = reward_model.split_pairs(pairs, 40, by_operands=True)
    assert len(held_out) in (39, 40) and len(train) + len(held_out) == len(pairs)
    train_keys = {tasks.addition_operands(r) for r in train}
    assert not train_keys & {tasks.addition_operands(r) for r in held_out}
    held_keys = [tasks.addition_operands(r) for r in held_out]
    assert len(held_keys) > len(set(held_keys)), "some problem should be held out together with its twin"
    assert reward_model.split_pairs(pairs, 40, by_operands=True)[1]["prompt"] == held_out["prompt"]  # fixed split
    user = datasets.Dataset.from_dict({"prompt": ["a", "a", "b", "c", "c", "d"], "chosen": ["x"] * 6, "rejected": ["y"] * 6})
    train, held_out = reward_model.split_pairs(user, 3, by_operands=False)
    assert not set(train["prompt"]) & set(held_out["prompt"]) and len(train) + len(held_out) == 6


def tiny_reward_model(seed=0):
    torch.manual_seed(seed)
    policy, input_ids, attention_mask, mask = tiny_model()
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    model = LlamaForSequenceClassification(config)
    return model.eval(), input_ids, attention_mask, mask


def test_sequence_rewards_reads_the_last_real_token_of_each_row():
    """The score is the head on the hidden state at the row's last attended token: the same as the row alone, without
    any padding, and unchanged by whatever ids sit on the padding (an EOS that doubles as the pad included)."""
    model, input_ids, attention_mask, _ = tiny_reward_model()
    scores = common.sequence_rewards(model, input_ids, attention_mask)
    assert scores.shape == (len(input_ids),)
    for i in range(len(input_ids)):
        ids = input_ids[i][attention_mask[i].bool()][None]
        alone = model.score(model.model(ids).last_hidden_state[:, -1]).squeeze()
        # Another batch shape: the CPU's kernels may order the float32 sums differently (see FORWARD_ATOL in
        # test_common.py): up to 1e-4 of the sizes involved, and the score's 128 products w h have sizes adding up to
        # < 2: it moves by < 2e-4. Reading the token before the last moves a score by 0.06 or more.
        assert scores[i].item() == pytest.approx(alone.item(), abs=2e-4)
    other = input_ids.masked_fill(attention_mask == 0, 2)  # other ids on padding
    # The same shapes and mask, so the same kernels in the same order; the new ids sit only where the attention weights
    # are exactly 0 or after the scored token: equal to the last bit, and 1e-6 (16 ulps at |score| < 0.5) leaves slack
    assert torch.allclose(common.sequence_rewards(model, other, attention_mask), scores, rtol=0, atol=1e-6)
    assert len(set(scores.tolist())) > 1


def test_reward_model_trains_then_scores_the_rollouts_of_ppo_and_grpo(model_dir, tmp_path, monkeypatch):
    """reward_model.py for a few steps on a user's pairs, then ppo.py and grpo.py against it: the policy's reward is the
    reward model's score (not a verifier's 0 or 1) and the verifier is logged beside it as the gold accuracy."""
    pairs = [
        {"prompt": f"{a:02d}+{b:02d}=", "chosen": str(a + b)[::-1], "rejected": str(a + b + 1)[::-1]}
        for a, b in [(7, 45), (13, 9), (20, 31), (8, 8), (41, 17), (66, 3)]
    ]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    rm_dir = tmp_path / "rm"
    flags = ["--dataset", str(tmp_path / "pairs.jsonl"), "--num-eval", "2", "--batch-size", "4", "--eval-every", "1"]
    run_here(
        monkeypatch,
        "reward_model.py",
        "--model-name-or-path",
        model_dir,
        "--output-dir",
        str(rm_dir),
        *flags,
        "--total-steps",
        "3",
        "--learning-rate",
        "1e-3",
        "--micro-batch-size",
        "2",
        "--device",
        "cpu",
    )
    logged = rows(rm_dir)
    assert [r["step"] for r in logged] == [0, 1, 2, 3] and logged[0]["data/pairs"] == 4 and logged[0]["data/eval_pairs"] == 2
    for key in ("loss/rm", "loss/centring", "train/pairwise_accuracy", "eval/pairwise_accuracy", "eval/margin"):
        assert key in logged[-1], key
    assert logged[3]["loss/rm"] < logged[1]["loss/rm"]  # three steps on four pairs: it fits them
    saved = rm_dir / "model"
    for script in ("ppo.py", "grpo.py"):
        out = tmp_path / script
        run_here(
            monkeypatch,
            script,
            "--model-name-or-path",
            model_dir,
            "--reward-model",
            str(saved),
            "--output-dir",
            str(out),
            *SMALL,
        )
        step = rows(out)[1]
        assert 0.0 <= step["rollout/gold_accuracy"] <= 1.0 and "eval/accuracy" in step
        assert step["rollout/reward_mean"] not in (0.0, 1.0)  # a learned score, not the verifier's


def test_verifier_pairs_are_built_once_and_cached(model_dir, tmp_path, monkeypatch):
    """dpo.py and reward_model.py share the pairs: built by the first caller (the only one to load the policy), read
    from the cache by the next. A verifier that calls answers of even length correct gives both kinds of answer."""
    monkeypatch.setattr(tasks.Task, "verify", lambda self, c, a: torch.tensor([float(len(x) % 2 == 0) for x in c]))
    task = tasks.make_task("addition")
    calls = []

    def load_policy():
        calls.append(1)
        return models.load_model_and_tokenizer(model_dir, "", torch.device("cpu"))

    settings = dict(model_name_or_path=model_dir, cache_dir=str(tmp_path), task="addition", max_new_tokens=8)
    first = preference_pairs.cached_verifier_pairs(
        reward_model.Args(**settings, num_pair_prompts=16, group_size=4), task, load_policy, "cpu"
    )
    again = preference_pairs.cached_verifier_pairs(
        reward_model.Args(**settings, num_pair_prompts=16, group_size=4), task, load_policy, "cpu"
    )
    assert calls == [1] and again[2] == 0.0 and again[1] == first[1] and again[0].to_list() == first[0].to_list()
    assert len(first[0]) + first[1] == 16 and len(first[0]) > 0


def test_bad_reward_models_are_refused_in_one_line(model_dir, tmp_path):
    import grpo

    with pytest.raises(SystemExit, match="--reward-model './nope': no such directory, and not a hub id"):
        grpo.check_args(grpo.Args(reward_model="./nope", output_dir=str(tmp_path)))
    _, tokenizer = models.load_model_and_tokenizer(model_dir, "", torch.device("cpu"))
    with pytest.raises(SystemExit, match="--reward-model .*: a LlamaForCausalLM, not a reward model") as info:
        models.load_reward_model(model_dir, torch.device("cpu"))  # the policy itself
    assert "\n" not in str(info.value.code)
    two = tiny_reward_model()[0]
    two.config.num_labels = 2
    two.save_pretrained(tmp_path / "two")
    tokenizer.save_pretrained(tmp_path / "two")
    with pytest.raises(SystemExit, match="has 2 outputs, a reward model has one"):
        models.load_reward_model(str(tmp_path / "two"), torch.device("cpu"))
    assert os.path.isdir(tmp_path / "two")
