"""The plumbing every script relies on: masks, sampling, log-probs, the task's verifier, argument checks."""

import pytest
import torch

import common
import sft
import tasks
from helpers import tiny_model, tiny_model_that_transforms_its_logits
from plumbing import dist, models


def test_completion_mask_runs_through_the_first_eos_only():
    eos = 1
    ids = torch.tensor([[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0], [5, 1, 1, 1]])  # the last one: pad id == eos id
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(common.completion_mask(ids, [eos]), expected)
    # several end tokens (a chat model's end-of-turn besides end-of-text): the first of any ends the response
    assert common.completion_mask(torch.tensor([[5, 9, 1, 4]]), [1, 9]).tolist() == [[True, True, False, False]]


class ScriptedModel(torch.nn.Module):
    """Stands in for a causal LM: row i emits token 5 until step script[i], then EOS (script[i] = -1: never EOS)."""

    def __init__(self, script, eos, prompt_ids, vocab=20):
        super().__init__()
        self.script, self.eos, self.prompt_ids, self.vocab, self.step = script, eos, prompt_ids, vocab, 0
        self.calls = 0

    def forward(self, input_ids, **kwargs):
        logits = torch.full((len(input_ids), input_ids.shape[1], self.vocab), -10.0)
        rows = range(len(input_ids))  # after the prompt pass, every row in order
        if self.step == 0:  # the prompt pass: each distinct prompt once (a repeated prompt's rows must agree here)
            rows = [next(j for j, p in enumerate(self.prompt_ids) if torch.equal(p, row)) for row in input_ids]
        for i, row in enumerate(rows):
            logits[i, -1, self.eos if self.step == self.script[row] else 5] = 10.0
        self.step, self.calls = self.step + 1, self.calls + 1
        return type("Out", (), {"logits": logits})()


def test_generate_marks_eos_padding_and_truncation():
    tokenizer = sft.build_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["1+2=", "13+45=", "7+7=", "99+99="], torch.device("cpu"))
    model = ScriptedModel([0, 2, 5, -1], eos, prompt_ids)
    ids, mask, truncated = common.generate(model, tokenizer, prompt_ids, prompt_mask, 5, temperature=0.0)
    assert ids.tolist() == [[eos, pad, pad, pad, pad], [5, 5, eos, pad, pad], [5, 5, 5, 5, 5], [5, 5, 5, 5, 5]]
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1] * 5, [1] * 5]
    assert truncated.tolist() == [False, False, True, True]
    model = ScriptedModel([0, 1, 2, 1], eos, prompt_ids)  # every row ends by the third token: generation stops there
    ids, mask, truncated = common.generate(model, tokenizer, prompt_ids, prompt_mask, 5, temperature=0.0)
    assert model.calls == 3 and ids.shape == (4, 3) and not truncated.any()
    assert common.decode(tokenizer, ids, mask, truncated) == ["", "2", "22", "2"]  # token 5 is the character "2"
    with pytest.raises(ValueError, match="left-padded"):
        common.generate(model, tokenizer, prompt_ids.flip(1), prompt_mask.flip(1), 5, temperature=0.0)


def test_generate_samples_from_softmax_of_logits_over_temperature():
    """Empirical first-token frequencies match softmax(logits / T) of a full forward pass. The untrained model is nearly
    uniform (no probability above 0.09), so T = 1 instead of 0.5 or 2 moves a probability by only 0.010 to 0.016: the
    draws are many enough that this is 10 binomial standard deviations or more."""
    model, *_ = tiny_model()
    tokenizer = sft.build_tokenizer()
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, ["13+45="], torch.device("cpu"))
    prompt_ids, prompt_mask = prompt_ids.expand(5000, -1), prompt_mask.expand(5000, -1)
    with torch.no_grad():
        logits = model(prompt_ids[:1]).logits[0, -1]
    for temperature in (0.5, 2.0):
        torch.manual_seed(0)
        draws = torch.cat([common.generate(model, tokenizer, prompt_ids, prompt_mask, 1, temperature)[0] for _ in range(8)])
        freq = torch.bincount(draws[:, 0], minlength=len(tokenizer)).double() / len(draws)
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        # A frequency of n = 40000 draws has the binomial std sqrt(p (1 - p) / n), at most 0.0014 here. 5 std: a false
        # alarm among the 2 x 18 frequencies has probability 36 * 5.7e-7 = 2e-5. (The forward's float32 noise moves p
        # by < 1e-3 of itself, see FORWARD_ATOL below: < 1e-4, far below 1 std.)
        std = (probs * (1 - probs) / len(draws)).sqrt()
        assert ((freq - probs).abs() <= 5 * std).all(), temperature


# Log-probs of the tiny Llama computed twice at different batch shapes: the CPU's kernels (AVX2, AVX-512, AMX, the
# number of threads) may order each float32 sum differently, and a reordered sum of K terms moves by up to K u times the
# sum of their sizes (u = 2^-24 = 6e-8). Through the body's 4 layers (sums of up to 384 terms) and the output layer
# (128 terms) that is (4 * 384 + 128) u = 1e-4 of the sizes involved. A logit's 128 products w h have sizes adding up
# to < 2: it moves by < 2e-4, and a log-prob (a logit minus a log-sum-exp over the vocabulary) by at most twice that.
# The bugs these tests look for (padding attended, a wrong position, temperature or chunk) move log-probs by 0.1 or more.
FORWARD_ATOL = 4e-4
# The same, where the body runs once on the same batch and only the output layer runs on another number of positions:
# a logit moves by < 128 u * 2 = 1.5e-5, a log-prob by < 2 * 1.5e-5 / T, at T >= 0.5 < 6e-5. The entropy H moves by at
# most sum p |log p + H| (< 1 for this near-uniform model) times the error of a logit / T: less than a log-prob.
OUTPUT_LAYER_ATOL = 6e-5


def test_logprobs_do_not_depend_on_left_padding():
    """Each row's log-probs are the same alone or left-padded in a batch: positions count from the first real token."""
    model, input_ids, attention_mask, mask = tiny_model(batch=4)
    batch_logprobs, _ = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0)
    for i in range(4):
        real = attention_mask[i, : input_ids.shape[1] - mask.shape[1]].bool()
        alone_ids = torch.cat([input_ids[i, : len(real)][real], input_ids[i, len(real) :]])[None]
        alone_mask = torch.cat([torch.ones(int(real.sum()), dtype=torch.long), attention_mask[i, len(real) :]])[None]
        alone, _ = common.completion_logprobs(model, alone_ids, alone_mask, mask.shape[1], 1.0)
        assert torch.allclose(alone[0][mask[i]], batch_logprobs[i][mask[i]], rtol=0, atol=FORWARD_ATOL)


def test_logprobs_match_the_sampling_distribution_at_temperature():
    """The log-prob of a sampled token is log softmax(logits / T), the distribution `generate` samples from."""
    model, input_ids, attention_mask, mask = tiny_model(batch=2)
    with torch.no_grad():
        position_ids = (attention_mask[1:].cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids[1:], attention_mask=attention_mask[1:], position_ids=position_ids).logits[0]
    for temperature in (0.5, 1.0, 2.0):
        logprobs, entropy = common.completion_logprobs(model, input_ids[1:], attention_mask[1:], mask.shape[1], temperature)
        prompt_len = input_ids.shape[1] - mask.shape[1]
        expected = torch.log_softmax(logits[prompt_len - 1 : -1] / temperature, dim=-1)
        targets = input_ids[1, prompt_len:]
        # the model's own forward and completion_logprobs run the body on the same row: only the output layer differs
        assert torch.allclose(logprobs[0], expected.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=OUTPUT_LAYER_ATOL)
        assert torch.allclose(entropy[0], -(expected.exp() * expected).sum(-1), rtol=0, atol=OUTPUT_LAYER_ATOL)


def test_generate_greedy_picks_the_argmax_and_matches_a_full_forward():
    """The KV-cached loop agrees with a full forward, for prompts that repeat (as a group's do), whose prompt pass runs
    once per distinct prompt and whose cache is then copied to every row."""
    model, *_ = tiny_model()
    tokenizer = sft.build_tokenizer()
    prompts = ["13+45=", "1+2=", "13+45=", "7+7=", "1+2=", "13+45="]
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, torch.device("cpu"))
    assert not prompt_mask[1].all()  # a left-padded prompt
    rows_per_pass = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: rows_per_pass.append(len(args[0] if args else kwargs["input_ids"])), with_kwargs=True
    )
    ids, mask, _ = common.generate(model, tokenizer, prompt_ids, prompt_mask, 5, 0.0)
    assert rows_per_pass[0] == 3 and set(rows_per_pass[1:]) == {6}  # the prompt pass on the 3 distinct prompts
    rows_per_pass.clear()
    input_ids = torch.cat([prompt_ids, ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    logprobs, _ = common.completion_logprobs(model, input_ids, attention_mask, ids.shape[1], 1.0)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    greedy = logits[:, prompt_ids.shape[1] - 1 : -1].argmax(dim=-1)
    assert torch.equal(greedy[mask], ids[mask])  # the KV-cached loop and a full forward agree
    assert torch.isfinite(logprobs[mask]).all()


def operands(prompt: str) -> frozenset:
    a, b = prompt.rstrip("=").split("+")
    return frozenset((int(a), int(b)))


def test_addition_task_is_fixed_disjoint_and_verified():
    task = tasks.make_task("addition")
    train, held_out = task.train[:], task.eval[:]  # dicts of lists
    assert len(task.eval) == 500 and len(task.train) == 10_000 - 500
    assert not set(held_out["prompt"]) & set(train["prompt"])
    # no leak through commutation: "07+45=" held out means "45+07=" (the same answer) is never trained on
    trained_pairs = {operands(p) for p in train["prompt"]}
    assert not [p for p in held_out["prompt"] if operands(p) in trained_pairs]
    twins = [p for p in held_out["prompt"] if len(operands(p)) == 2]
    assert twins and all(f"{p[3:5]}+{p[:2]}=" in held_out["prompt"] for p in twins)  # both orders held out together
    assert tasks.make_task("addition").eval[:]["prompt"] == held_out["prompt"]  # the held-out split never moves
    answers = dict(zip(train["prompt"] + held_out["prompt"], train["answer"] + held_out["answer"]))
    assert answers["07+45="] == "25" and answers["68+57="] == "521" and answers["00+00="] == "0"  # sum, reversed
    reward = task.verify(["46", " 46 ", "47", "", "046"], ["46"] * 5)
    assert reward.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_scratchpad_task_is_fixed_disjoint_long_and_verified():
    task = tasks.make_task("scratchpad")
    train, held_out = task.train[:], task.eval[:]
    assert len(task.eval) == 500 and len(task.train) == 20_000 - 500 and task.max_new_tokens == 64
    trained_pairs = {operands(p) for p in train["prompt"]}
    assert not [p for p in held_out["prompt"] if operands(p) in trained_pairs]  # no problem and no commuted twin leaks
    assert tasks.make_task("scratchpad").eval[:]["prompt"] == held_out["prompt"]  # the held-out split never moves
    # worked by hand: columns from the least significant digit, the carry written as "+1", then " =" and the sum
    assert tasks.scratchpad_solution(482, 396) == "2+6=8 8+9=17 4+3+1=8 =878"
    assert tasks.scratchpad_solution(999, 1) == "9+1=10 9+0+1=10 9+0+1=10 =1000"
    assert tasks.scratchpad_solution(5, 3) == "5+3=8 0+0=0 0+0=0 =8"
    a, b = map(int, train["prompt"][0].rstrip("=").split("+"))
    assert train["answer"][0] == str(a + b) and train["solution"][0] == tasks.scratchpad_solution(a, b)
    lengths = [len(s) + 1 for s in train["solution"]]  # one token per character, and EOS
    assert min(lengths) == 21 and max(lengths) == 31 and 2 * max(lengths) < task.max_new_tokens
    # only the final answer counts: the number after the last lone "=", whatever the working says
    completions = ["2+6=8 8+9=17 4+3+1=8 =878", "1+1=5 =878", "2+6=8 8+9=17 4+3+1=8", "=877 =878", "x =87 8", "878"]
    assert task.verify(completions, ["878"] * 6).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_lengths_by_outcome_splits_correct_from_wrong_and_skips_an_empty_side():
    lengths, scores = torch.tensor([20, 30, 40, 25]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    got = common.lengths_by_outcome(lengths, scores)
    # exactly: means of two integers are halves
    assert got["rollout/response_length_correct"].mean().item() == 22.5 and got["rollout/response_length_wrong"].mean() == 35.0
    assert list(common.lengths_by_outcome(lengths, torch.zeros(4))) == ["rollout/response_length_wrong"]


def test_gsm8k_verifier_reads_the_last_number():
    assert tasks.gsm8k_answer("so 3 + 4 = 7. The answer is 1,234.") == "1234"
    assert tasks.gsm8k_answer("no number here") is None


def test_split_by_key_keeps_every_key_on_one_side():
    import datasets

    ds = datasets.Dataset.from_dict({"prompt": [f"q{i % 7}" for i in range(40)], "answer": [str(i) for i in range(40)]})
    rest, held = tasks.split_by_key(ds, 12, lambda row: row["prompt"], seed=0)
    assert len(rest) + len(held) == 40 and 0 < len(held) <= 12
    assert not set(rest["prompt"]) & set(held["prompt"])
    again = tasks.split_by_key(ds, 12, lambda row: row["prompt"], seed=0)[1]
    assert again["answer"] == held["answer"]  # fixed by its seed


def test_pool_metrics_takes_the_mean_and_the_min_and_max_only_where_asked():
    rows = [{"a": torch.tensor(1.0), "x": torch.tensor([2.0, 0.5])}, {"a": torch.tensor(3.0), "x": 5.0}]
    # exactly: the sum 7.5 is exact and 7.5 / 3 = 2.5 is a float, so the division's one rounding changes nothing
    assert common.pool_metrics(rows) == {"a": 2.0, "x": 2.5}
    pooled = common.pool_metrics(rows, min_max=("x",))
    assert pooled == {"a": 2.0, "x": 2.5, "x_min": 0.5, "x_max": 5.0}


def test_pool_metrics_weights_micro_batches_by_their_samples():
    """Three valid tokens in one micro-batch and one in the other: the token mean is 7 / 4, not the mean of means 2.5."""
    rows = [{"kl/old_approx": torch.tensor([1.0, 1.0, 1.0])}, {"kl/old_approx": torch.tensor([4.0])}, {"train/grad_norm": 2.0}]
    out = common.pool_metrics(rows)
    assert out["kl/old_approx"].item() == 7 / 4 and out["train/grad_norm"].item() == 2.0  # exactly: 7 / 4 is a binary fraction


def test_decode_keeps_every_token_of_a_truncated_row():
    tokenizer = sft.build_tokenizer()
    eos, two = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("2")
    ids = torch.tensor([[two, two, two], [two, eos, 0], [eos, 0, 0]])
    mask = common.completion_mask(ids, [eos])
    truncated = torch.tensor([True, False, False])
    assert common.decode(tokenizer, ids, mask, truncated) == ["222", "2", ""]


def test_cat_padded_pads_right_or_left_and_concatenates_vectors():
    a, b = torch.tensor([[1, 2, 3]]), torch.tensor([[4], [5]])
    assert common.cat_padded([a, b]).tolist() == [[1, 2, 3], [4, 0, 0], [5, 0, 0]]
    assert common.cat_padded([a, b], value=9, left=True).tolist() == [[1, 2, 3], [9, 9, 4], [9, 9, 5]]
    assert common.cat_padded([torch.tensor([True]), torch.tensor([False, True])]).tolist() == [True, False, True]


def test_evaluate_scores_greedy_answers_against_the_held_out_split():
    """A scripted model answers "2" then EOS for rows 0 and 2, "22" then EOS for row 1, and never ends row 3."""
    import datasets

    tokenizer = sft.build_tokenizer()
    data = datasets.Dataset.from_dict({"prompt": ["1+1=", "11+11=", "1+1=", "1+1="], "answer": ["2", "22", "3", "2"]})
    prompt_ids, _ = common.tokenize_prompts(tokenizer, list(data["prompt"]), torch.device("cpu"))
    model = ScriptedModel([1, 2, 1, -1], tokenizer.eos_token_id, prompt_ids)
    model.weight = torch.nn.Parameter(torch.zeros(1))  # evaluate reads the device from the parameters
    task = tasks.Task("scripted", data, data, tasks.addition_answer)
    out = common.evaluate(model, tokenizer, task, max_new_tokens=3)
    # exactly: counts over 4 rows are binary fractions
    assert out["eval/accuracy"] == 0.5  # rows 0 and 1 right; row 2 wrong; row 3 truncated at "222"
    assert out["eval/response_length"] == (2 + 3 + 2 + 3) / 4
    assert out["samples"] == [  # what it said to the first problems, for samples.jsonl
        {"prompt": "1+1=", "completion": "2", "answer": "2", "reward": 1.0},
        {"prompt": "11+11=", "completion": "22", "answer": "22", "reward": 1.0},
        {"prompt": "1+1=", "completion": "2", "answer": "3", "reward": 0.0},
        {"prompt": "1+1=", "completion": "222", "answer": "2", "reward": 0.0},
    ]
    assert len(common.evaluate(model, tokenizer, task, max_new_tokens=3, num_samples=2)["samples"]) == 2


def test_check_finite_names_the_step():
    common.check_finite(torch.tensor(1.0), "loss", 3)
    with pytest.raises(SystemExit, match="non-finite loss at step 7"):
        common.check_finite(torch.tensor(float("nan")), "loss", 7)


def test_model_paths():
    models.check_model_path("builtin")
    models.check_model_path("Qwen/Qwen2.5-0.5B")  # a hub id is left to from_pretrained
    for bad in ("/no/such/model", "./missing", "runs/a/b/model"):
        with pytest.raises(SystemExit, match="--model-name-or-path"):
            models.check_model_path(bad)


def test_logprobs_in_chunks_equal_the_whole_pass_with_their_gradient(monkeypatch):
    """Log-probs, entropies and the gradient they carry are the same whether the output layer runs over all 20 positions
    at once or 7 positions at a time, and the same as through the model's own forward (the path of models that transform
    their logits). The output layer never sees more than a chunk of positions, and each chunk runs twice with a
    gradient (recomputed in the backward pass) and once without."""
    model, input_ids, attention_mask, mask = tiny_model(batch=4)
    assert not common.transforms_logits(model)  # checked once, at the first log-probs: not counted below
    head_positions = []  # positions of each call of the output layer (the model's own forward asks for 1 per row)
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: head_positions.append(out.shape[:-1].numel()))

    plain = common.LOGIT_TRANSFORMS

    def run(chunk, transforms=plain):
        monkeypatch.setattr(common, "LOGITS_CHUNK", chunk)
        monkeypatch.setattr(common, "LOGIT_TRANSFORMS", transforms)
        model.zero_grad()
        head_positions.clear()
        logprobs, entropy = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 0.7, entropy_grad=True)
        (logprobs[mask].sum() + 0.1 * entropy[mask].sum()).backward()
        return logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()], list(head_positions)

    vocab = model.get_output_embeddings().weight.shape[0]
    whole, chunked, forward = run(2**24), run(7 * vocab), run(2**24, ("vocab_size",))
    assert whole[3] == [4, 20, 20] and chunked[3] == [4, 7, 7, 6, 6, 7, 7] and forward[3] == [4 * 6]  # 4 x (T + 1)
    # The body runs once on the same batch; the output layer runs on 7 or 20 positions at a time (OUTPUT_LAYER_ATOL). The
    # gradient adds the same per-position contributions in another order: a reordered fp32 sum of n terms differs by up
    # to about n * eps times their magnitude. We allow 8 times that at the scale of each gradient (contributions of single
    # positions can exceed their total, which partly cancels): 8 n eps = 160 eps = 2e-5, which also covers the
    # contributions' own change (logits moved by < 1.5e-5); a wrong chunk or temperature differs by far more.
    eps, n = torch.finfo(torch.float32).eps, mask.shape.numel()
    for other in (chunked, forward):
        assert torch.allclose(other[0], whole[0], rtol=0, atol=OUTPUT_LAYER_ATOL)
        assert torch.allclose(other[1], whole[1], rtol=0, atol=OUTPUT_LAYER_ATOL)
        assert all(torch.allclose(a, b, rtol=0, atol=8 * n * eps * b.abs().max()) for a, b in zip(other[2], whole[2]))
    assert any(g.abs().sum() > 0 for g in whole[2])
    monkeypatch.setattr(common, "LOGIT_TRANSFORMS", plain)  # chunks of 7 positions, without a gradient
    monkeypatch.setattr(common, "LOGITS_CHUNK", 7 * vocab)
    with torch.no_grad():
        head_positions.clear()
        logprobs, entropy = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 0.7)
    assert torch.allclose(logprobs, whole[0], rtol=0, atol=OUTPUT_LAYER_ATOL)
    assert not entropy.requires_grad and head_positions == [4, 7, 7, 6]


def test_gradient_checkpointing_recomputes_the_layers_and_leaves_the_gradient_unchanged():
    model, input_ids, attention_mask, mask = tiny_model(batch=4)
    assert not common.transforms_logits(model)  # checked once, at the first log-probs: not counted below
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))

    def gradient():
        model.zero_grad()
        calls.clear()
        logprobs, _ = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0)
        logprobs[mask].sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = gradient()
    assert len(calls) == 1
    models.enable_gradient_checkpointing(model)
    checkpointed = gradient()
    assert len(calls) == 2  # the layer ran again in the backward pass
    # The recomputation runs the same kernels on the same shapes; at most the order in which autograd adds the n
    # positions' contributions may change: 8 n eps of each gradient's scale, as in the chunked test above.
    eps, n = torch.finfo(torch.float32).eps, mask.shape.numel()
    assert all(torch.allclose(a, b, rtol=0, atol=8 * n * eps * a.abs().max()) for a, b in zip(plain, checkpointed))
    model.config.attention_dropout = 0.1
    with pytest.raises(SystemExit, match="--gradient-checkpointing: this model has dropout"):
        models.enable_gradient_checkpointing(model)


def test_global_count_per_rank_in_one_process_is_the_count_at_least_one():
    """In one process the share is the whole count, never below 1 (an empty minibatch divides by 1, not 0)."""
    assert (
        dist.global_count_per_rank(torch.tensor(5)).item() == 5.0 and dist.global_count_per_rank(torch.tensor(0)).item() == 1.0
    )
    assert dist.shard(list(range(6))) == list(range(6)) and dist.concat_over_ranks(torch.arange(3)).tolist() == [0, 1, 2]


def test_two_runs_building_the_same_cache_keep_the_copy_that_finished_first(tmp_path):
    """Two scripts started at once on an empty cache both warm up (or build the pairs) in folders of their own; the
    first to finish is moved into place, and the second, finding it there, drops its copy instead of failing."""
    path, first, second = tmp_path / "builtin", tmp_path / "builtin.partial-1", tmp_path / "builtin.partial-2"
    for folder, text in ((first, "first"), (second, "second")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    models.move_into_place(str(first), str(path))
    models.move_into_place(str(second), str(path))
    assert (path / "config.json").read_text() == "first" and not first.exists() and not second.exists()


def own_forward_logprobs(model, input_ids, attention_mask, completion_len, temperature):
    """log softmax(logits / T) at the completion tokens, from the logits of the model's own forward."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
    logprobs = torch.log_softmax(logits[:, -completion_len - 1 : -1].float() / temperature, dim=-1)
    return logprobs.gather(-1, input_ids[:, -completion_len:, None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["falcon_h1", "recurrent_gemma", "gemma3n"])
def test_a_model_that_transforms_its_logits_is_scored_like_its_own_forward(kind):
    """The chunked output layer would skip the transform (a scale of 0.3 or a soft cap at 1 move log-probs by a tenth of
    a nat or more): such a model is scored through its own forward, so that sampling and scoring agree."""
    model = tiny_model_that_transforms_its_logits(kind)
    _, input_ids, attention_mask, mask = tiny_model(batch=4)
    expected = own_forward_logprobs(model, input_ids, attention_mask, mask.shape[1], 0.7)
    with torch.no_grad():
        logprobs, _ = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 0.7)
    # the body runs on the same batch, the output layer on all or on the completion's positions: a logit (32 products
    # w h of summed size < 2) moves by < 32 u * 2 = 4e-6, a log-prob at T = 0.7 by < 2 * 4e-6 / 0.7 = 1.1e-5
    assert torch.allclose(logprobs, expected, rtol=0, atol=2e-5)


def test_a_softcap_on_the_text_config_of_a_multimodal_config_is_read():
    """Gemma 3n loaded through AutoModelForCausalLM keeps its softcapping on the text config of its Gemma3nConfig, not on
    the top-level config (building the whole multimodal model needs timm: its config is what is read)."""
    from types import SimpleNamespace

    from transformers import Gemma3nConfig

    config = Gemma3nConfig(text_config=tiny_model_that_transforms_its_logits("gemma3n").config.to_dict())
    assert getattr(config, "final_logit_softcapping", None) is None and config.get_text_config().final_logit_softcapping
    assert common.transforms_logits(SimpleNamespace(config=config))


def test_a_transform_that_no_config_field_names_is_found_at_the_first_logprobs(monkeypatch, tmp_path):
    """With LOGIT_TRANSFORMS emptied, Falcon-H1's multiplier goes unnamed: at the model's first log-probs the chunked
    output layer is compared with the model's forward on a short input, found apart, and the model marked; its log-probs,
    those first ones included, are then its own forward's."""
    monkeypatch.setattr(common, "LOGIT_TRANSFORMS", ())
    tiny_model_that_transforms_its_logits("falcon_h1").save_pretrained(tmp_path)
    sft.build_tokenizer().save_pretrained(tmp_path)
    model, _ = models.load_model_and_tokenizer(str(tmp_path), "", torch.device("cpu"))
    assert not hasattr(model, "logits_transformed")  # not checked before its first log-probs
    _, input_ids, attention_mask, mask = tiny_model(batch=4)
    with torch.no_grad():
        logprobs, _ = common.completion_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0)
    assert model.logits_transformed
    expected = own_forward_logprobs(model, input_ids, attention_mask, mask.shape[1], 1.0)
    assert torch.allclose(logprobs, expected, rtol=0, atol=2e-5)  # as in the test above (hidden size 32, T = 1)
    tokenizer = sft.build_tokenizer()
    sft.build_tiny_model(tokenizer).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    llama, _ = models.load_model_and_tokenizer(str(tmp_path / "llama"), "", torch.device("cpu"))
    common.completion_logprobs(llama, input_ids, attention_mask, mask.shape[1], 1.0)
    assert llama.logits_transformed is False  # checked: the chunked output layer is its forward, kept
