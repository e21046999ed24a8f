"""--lora-rank: a LoRA adapter trained through peft on the frozen weights. The reference of the KL penalty is the same
module with the adapter switched off, the optimizer and the checkpoint hold only the adapter, and the saved folder
holds the adapter and the merged model; the frozen weights may be bf16. And --track: every logged row in trackio."""

import json
import types

import pytest
import torch
from safetensors.torch import load_file
from test_smoke import SMALL, coin_flip_rewards, rows, run_here
from transformers import AutoConfig, AutoModelForCausalLM

import common
from plumbing import checks, lora, models

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")


def lora_args(**kw):
    defaults = dict(lora_rank=4, lora_alpha=0, lora_target_modules=lora.ALL_LINEAR, lora_base_dtype="auto")
    return types.SimpleNamespace(**{**defaults, **kw})


def some_rollouts(tokenizer, device=CPU):
    prompts = ["12+34=", "5+67=", "80+9="]
    prompt_ids, prompt_mask = common.tokenize_prompts(tokenizer, prompts, device)
    completion = tokenizer(["46", "72", "89"], return_tensors="pt", add_special_tokens=False).input_ids
    input_ids = torch.cat([prompt_ids, completion], dim=1)
    return input_ids, torch.ones_like(input_ids), completion.shape[1]


def move_the_adapter(model, seed=0):
    """B starts at zero (the adapter's output is 0): give every adapter weight seeded noise, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))


def test_the_reference_is_the_policy_with_its_adapter_switched_off(model_dir):
    """The reference log-probs come from the policy's own module with the adapter off, and equal those of the base
    model loaded on its own, exactly (the same arithmetic); the policy's own differ, and its adapter stays trainable."""
    base, tokenizer = models.load_model_and_tokenizer(model_dir, "", CPU)
    policy = lora.add_adapter(models.load_model_and_tokenizer(model_dir, "", CPU)[0], lora_args())
    move_the_adapter(policy)
    reference = lora.WithoutAdapter(policy)
    assert reference.model is policy
    assert {id(p) for p in reference.parameters()} == {id(p) for p in policy.parameters()}  # no second copy
    input_ids, attention_mask, T = some_rollouts(tokenizer)
    ref_logprobs = common.logprobs_no_grad(reference, input_ids, attention_mask, T, 1.0, 2)
    base_logprobs = common.logprobs_no_grad(base, input_ids, attention_mask, T, 1.0, 2)
    policy_logprobs = common.logprobs_no_grad(policy, input_ids, attention_mask, T, 1.0, 2)
    assert torch.equal(ref_logprobs, base_logprobs)
    assert (policy_logprobs - base_logprobs).abs().max() > 1e-2
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
    assert not any(p.requires_grad for n, p in policy.named_parameters() if "lora_" not in n)


def test_a_fresh_adapter_leaves_the_model_as_it_was_and_only_the_adapter_gets_gradients(model_dir):
    base, tokenizer = models.load_model_and_tokenizer(model_dir, "", CPU)
    policy = lora.add_adapter(models.load_model_and_tokenizer(model_dir, "", CPU)[0], lora_args())
    input_ids, attention_mask, T = some_rollouts(tokenizer)
    logprobs, _ = common.completion_logprobs(policy, input_ids, attention_mask, T, 1.0)
    # B = 0: each adapted layer adds exact zeros to the same base product, so the same call on the base is equal, bit
    # for bit (no tolerance: any difference is the adapter's)
    assert torch.equal(logprobs, common.completion_logprobs(base, input_ids, attention_mask, T, 1.0)[0])
    logprobs.sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters()}
    assert all(g is None for n, g in grads.items() if "lora_" not in n)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # dW = B A: B moves first, from 0


def test_the_frozen_weights_may_be_bf16_under_an_fp32_adapter(model_dir):
    args = lora_args(lora_base_dtype="bfloat16")
    dtype = lora.base_dtype(args, CPU)
    assert dtype == torch.bfloat16 and lora.base_dtype(lora_args(), CPU) == torch.float32  # auto on the CPU: fp32
    assert lora.base_dtype(lora_args(lora_rank=0, lora_base_dtype="bfloat16"), CPU) == torch.float32  # trained: fp32
    policy, tokenizer = models.load_model_and_tokenizer(model_dir, "", CPU, dtype=dtype)
    policy = lora.add_adapter(policy, args)
    dtypes = {n: p.dtype for n, p in policy.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    input_ids, attention_mask, T = some_rollouts(tokenizer)
    logprobs, _ = common.completion_logprobs(policy, input_ids, attention_mask, T, 1.0)
    logprobs.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.requires_grad)


def test_an_adapter_over_bf16_weights_is_merged_in_float32(model_dir, tmp_path):
    """A small update to bf16 weights survives the merge: the saved model holds W + (alpha / r) B A in float32, not the
    bf16 rounding of it, which gives most weights back unchanged when the update is below 2^-9 of them."""
    policy, tokenizer = models.load_model_and_tokenizer(model_dir, "", CPU, dtype=torch.bfloat16)
    policy = lora.add_adapter(policy, lora_args(lora_base_dtype="bfloat16"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:  # B A of size about 1e-4 * 1e-1 * 4 terms: far below 2^-9 of a weight of size 1e-2
                p.copy_((1e-2 if "lora_B" in name else 1e-1) * torch.randn(p.shape, generator=generator))
    layer = policy.model.layers[0].self_attn.q_proj
    expected = layer.get_base_layer().weight.float() + layer.scaling["default"] * layer.lora_B["default"].weight @ (
        layer.lora_A["default"].weight
    )
    lora.save_merged(policy, tokenizer, str(tmp_path))
    saved = load_file(tmp_path / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert saved.dtype == torch.float32
    # float32: W (bf16, exact in float32) plus a sum of 4 products of size 1e-3, rounded once: within 1e-6 of expected
    assert torch.allclose(saved, expected, rtol=0, atol=1e-6)
    assert not torch.equal(saved, expected.bfloat16().float())  # the bf16 rounding lost part of the update


def test_a_lora_run_loads_one_model_trains_the_adapter_and_saves_both_forms(model_dir, tmp_path, monkeypatch):
    """grpo.py --lora-rank 4 with its KL penalty: the model is loaded once (the reference is the policy without its
    adapter), the checkpoint holds the adapter's weights only, and the saved folder loads with from_pretrained (the
    merged model) and with peft (base + adapter), both giving the trained policy's log-probs."""
    coin_flip_rewards(monkeypatch)  # the briefly warmed-up model answers nothing right: no reward, no gradient
    loads = []
    load = models.load_model  # (load_model_and_tokenizer, which the reference would use, calls it too)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: loads.append(a) or load(*a, **kw))
    out = tmp_path / "run"
    flags = [*SMALL, "--model-name-or-path", model_dir, "--lora-rank", "4", "--beta", "0.04", "--save-every", "2"]
    run_here(monkeypatch, "grpo.py", *flags, "--output-dir", str(out))
    assert len(loads) == 1
    assert "kl/ref" in rows(out)[-1]
    trained = torch.load(out / "checkpoint.pt", weights_only=False)["trained"]
    targets = 7 * AutoConfig.from_pretrained(model_dir).num_hidden_layers  # q, k, v, o, gate, up, down in each layer
    assert len(trained) == 2 * targets and {min(t.shape) for t in trained} == {4}  # A (4 x in) and B (out x 4) each
    assert sum(t.numel() for t in trained) < 0.1 * sum(t.numel() for t in load_file(f"{model_dir}/model.safetensors").values())

    merged = AutoModelForCausalLM.from_pretrained(out / "model")
    base, tokenizer = models.load_model_and_tokenizer(model_dir, "", CPU)
    adapted = peft.PeftModel.from_pretrained(base, out / "model" / "adapter")
    input_ids, attention_mask, T = some_rollouts(tokenizer)
    merged_logprobs = common.logprobs_no_grad(merged, input_ids, attention_mask, T, 1.0, 3)
    adapted_logprobs = common.logprobs_no_grad(adapted, input_ids, attention_mask, T, 1.0, 3)
    with lora.adapter_disabled(adapted):
        base_logprobs = common.logprobs_no_grad(adapted, input_ids, attention_mask, T, 1.0, 3)
    # The same fp32 function summed in another order, (W + s B A) x against W x + s B (A x): a few ulps (eps 1.2e-7) per
    # layer of activations of order 1, through 4 layers and the output layer, and log-softmax keeps errors absolute:
    # 1e-5 is about 80 ulps at magnitude 1; a trained adapter moves them by more than 1e-4 (the next line)
    assert torch.allclose(merged_logprobs, adapted_logprobs, atol=1e-5)
    assert (merged_logprobs - base_logprobs).abs().max() > 1e-4  # the adapter was trained


def test_bad_lora_and_track_flags_are_refused_in_one_line(monkeypatch):
    import importlib.util

    import grpo

    base = dict(lora_rank=4, lora_alpha=0, lora_target_modules="all-linear", lora_base_dtype="auto", track=False)
    cases = [
        ({"lora_rank": -1}, "--lora-rank -1: must be 0"),
        ({"lora_alpha": -2}, "--lora-alpha -2: must be 0"),
        ({"lora_base_dtype": "fp16"}, "--lora-base-dtype 'fp16': allowed values are auto, float32, bfloat16"),
        ({"lora_rank": 0, "lora_base_dtype": "bfloat16"}, "--lora-base-dtype bfloat16: only the frozen weights"),
        ({"lora_target_modules": " , "}, "--lora-target-modules '': name the layers"),
        ({"fsdp": True}, "--fsdp with --lora-rank: not supported"),
    ]
    for changes, message in cases:
        with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
            checks.adapter_and_tracker(types.SimpleNamespace(**{**base, **changes}))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("trackio", "peft") else find_spec(name))
    with pytest.raises(SystemExit, match=r"^--track: needs the trackio package \(pip install trackio\)$"):
        grpo.check_args(grpo.Args(track=True))
    with pytest.raises(SystemExit, match=r"^--lora-rank: needs the peft package \(pip install peft\)$"):
        grpo.check_args(grpo.Args(lora_rank=8))


def test_unknown_target_modules_are_refused_in_one_line(model_dir):
    policy, _ = models.load_model_and_tokenizer(model_dir, "", CPU)
    with pytest.raises(SystemExit, match=r"^--lora-target-modules 'qkv': "):
        lora.add_adapter(policy, lora_args(lora_target_modules="qkv"))


def test_track_logs_every_row_the_flags_and_the_samples_to_trackio(model_dir, tmp_path, monkeypatch):
    trackio = pytest.importorskip("trackio")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio", raising=False)
    out = tmp_path / "grpo_tracked"
    flags = [*SMALL, "--model-name-or-path", model_dir, "--track", "--track-project", "test-project"]
    run_here(monkeypatch, "grpo.py", *flags, "--output-dir", str(out))
    logged = trackio.SQLiteStorage.get_logs("test-project", "grpo_tracked")
    numbers = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "timestamp", "samples")} for r in logged}
    assert {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in rows(out)} == numbers
    config = trackio.SQLiteStorage.get_run_config("test-project", "grpo_tracked")
    assert config["group_size"] == 4 and config["model_name_or_path"] == model_dir
    tables = [r["samples"]["_value"] for r in logged if "samples" in r]
    with open(out / "samples.jsonl") as f:
        first = json.loads(f.readline())
    assert len(tables) == 3 and tables[0][0] == {k: v for k, v in first.items() if k != "step"}  # steps 0, 1, 2


@pytest.mark.parametrize("script", ["dpo.py", "reward_model.py"])
def test_dpo_and_the_reward_model_train_an_adapter_and_save_a_model_that_loads(model_dir, tmp_path, monkeypatch, script):
    """dpo.py (with --gradient-checkpointing too) and reward_model.py with --lora-rank: only the adapter (and the
    reward model's new head, whole) is trained and checkpointed, and the saved folder loads with from_pretrained."""
    from transformers import AutoModelForSequenceClassification

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": f"{a:02d}+11=", "chosen": "1", "rejected": "22"}) for a in range(8)))
    out = tmp_path / script[:-3]
    flags = ["--model-name-or-path", model_dir, "--dataset", str(pairs), "--num-eval", "2", "--batch-size", "4"]
    flags += ["--total-steps", "2", "--save-every", "2", "--device", "cpu", "--lora-rank", "4", "--output-dir", str(out)]
    flags += ["--gradient-checkpointing"] if script == "dpo.py" else ["--learning-rate", "1e-3"]
    run_here(monkeypatch, script, *flags)
    trained = torch.load(out / "checkpoint.pt", weights_only=False)["trained"]
    hidden = AutoConfig.from_pretrained(model_dir).hidden_size
    heads = [t for t in trained if t.shape == (1, hidden)]  # the reward model's score head
    assert len(heads) == (script == "reward_model.py") and all(min(t.shape) == 4 for t in trained if t.shape != (1, hidden))
    auto_class = AutoModelForSequenceClassification if script == "reward_model.py" else AutoModelForCausalLM
    saved = auto_class.from_pretrained(out / "model")
    if script == "reward_model.py":
        assert torch.equal(saved.score.weight, heads[0])  # the head the run trained, not a new one
        # the adapter folder alone, on the base model, also carries the trained head (peft's modules_to_save)
        base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
        adapted = peft.PeftModel.from_pretrained(base, out / "model" / "adapter")
        assert torch.equal(adapted.base_model.model.score.modules_to_save["default"].weight, heads[0])
        ids = torch.tensor([[3, 4, 5, 6]])
        # the same float32 arithmetic but for W x + B A x against (W + B A) x: sums of 64-128 terms of size < 10
        assert torch.allclose(adapted(input_ids=ids).logits, saved(input_ids=ids).logits, atol=1e-4)
