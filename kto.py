"""KTO: Kahneman-Tversky optimisation on unpaired desirable and undesirable answers (Ethayarajh et al. 2024, "KTO: Model
Alignment as Prospect Theoretic Optimization", §4).

KTO needs no pairs: each answer is only labelled desirable or undesirable. Its implicit reward is DPO's log-ratio
r = log pi(y | x) - log pi_ref(y | x), judged against a reference point z0 = KL(pi || pi_ref), the reward a typical
answer gets: a desirable answer's value is lambda_D sigmoid(beta (r - z0)), an undesirable one's
lambda_U sigmoid(beta (z0 - r)), and the loss is lambda_y minus the value: a desirable answer gains only by
rising above what the policy's drift gives every answer, an undesirable one only by falling below it. The paper
estimates z0 on the batch: each prompt x_i is paired with the completion y_j of another example, never written
for it, and z0 = max(0, mean over i of log pi(y_j | x_i) - log pi_ref(y_j | x_i)), with no gradient through it.
Sequence log-probs are sums over the completion tokens.

    python kto.py

Built-in data: the warm-up policy answers each of `num_pair_prompts` training problems `group_size` times; a correct
and a wrong answer to the same problem make a pair (problems without both are skipped and counted), and each pair gives
two unpaired examples, its correct answer desirable and its wrong one undesirable. The pairs are built once and cached
(dpo.py's), and the policy is evaluated on the task's held-out problems. `--dataset` takes any local or hub data set
with prompt / completion / label columns instead (label true for desirable): `--num-eval` of its examples are held out
by prompt, and the implicit reward is evaluated on them (the fraction on its label's side of z0); with an `answer`
column, the held-out prompts are also answered greedily and scored by the `--task` verifier. Nothing is then read from
the hub.

Departures from the paper:
1. Labels come from the task's verifier (a correct answer is desirable), not from human judgement, and the reference
   model is the warm-up policy that also produced the answers.
2. Each completion ends with EOS, which counts as a token of the response (it is the policy's decision to stop).
3. The reference log-probs are computed once, before training; dropout stays off (eval mode), so they are exact. Those
   of the mismatched pairs change with each batch: a frozen copy of the warm-up computes them.
4. Built-in data: the examples come in equal numbers from pairs (lambda_D = lambda_U = 1, as the paper advises for a
   balanced set), though KTO does not need the pairing; a batch of 128 examples holds as many answers as dpo.py's 64
   pairs. The mismatched completion of each prompt is that of the example before it in the batch.
5. beta = 1.0, not the paper's 0.1, as in dpo.py: on addition at this learning rate, beta = 0.1 peaks near 67% held
   out after 20 steps and falls to 55-60% at 40; beta = 1.0 reaches 67-70% at 40.
"""

import os
import time
from dataclasses import dataclass

import torch
import tyro
from tqdm import tqdm

import common
import preference_pairs
import tasks
from plumbing import checks, dist, lora, models, run_state


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the script's name)"""
    seed: int = 1
    """seed of prompt sampling, generation and minibatch order"""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda"""
    model_name_or_path: str = "builtin"
    """'builtin' (the tiny model after its cached warm-up, see sft.py), a local folder, or a hub id"""
    cache_dir: str = ""
    """where the built-in model is cached (default: $TINY_RLHF_CACHE or ~/.cache/tiny-rlhf)"""
    task: str = "addition"
    """'addition' or 'scratchpad' (offline, for the built-in model), 'sums' (offline, for a chat model) or 'gsm8k' (hub)"""
    chat_template: str = "auto"
    """auto: prompts rendered with the tokenizer's chat template when it has one (the task's answer format as the
    system message); none: plain prompts; on: like auto, but a template is required"""
    instruction: str = ""
    """the system message a chat model gets with each prompt: the answer format (default: the task's own, e.g. for
    --dataset prompts scored like gsm8k, "Solve the problem step by step. End your reply with ... a plain number.")"""
    output_dir: str = ""
    """where metrics.jsonl and the final model go (default: runs/EXP_NAME__SEED)"""
    eval_every: int = 20
    """evaluate greedy held-out accuracy every this many steps (and before the first and after the last)"""
    save_every: int = 50
    """save a checkpoint (trained weights, optimizer, random states, step) every this many steps, and when interrupted"""
    resume: bool = False
    """continue the run in --output-dir from its checkpoint, appending to its metrics.jsonl"""
    overwrite: bool = False
    """start afresh in an --output-dir that holds another run, replacing its metrics, samples and checkpoint"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass instead of storing them: less memory, slower steps"""
    fsdp: bool = False
    """under torchrun: shard weights, gradients and optimizer state over the processes (FSDP2) instead of replicating
    them (data parallel); see docs/more-gpus.md"""

    lora_rank: int = 0
    """train a LoRA adapter of this rank on the frozen weights instead of every weight (0: every weight; needs peft)"""
    lora_alpha: int = 0
    """the adapter's output is scaled by lora_alpha / lora_rank (0: twice the rank, a scale of 2)"""
    lora_target_modules: str = "all-linear"
    """the layers that get an adapter: all-linear (every linear layer but the output layer: the attention and MLP
    projections) or names separated by commas, e.g. q_proj,v_proj"""
    lora_base_dtype: str = "auto"
    """with --lora-rank, the frozen weights' dtype: float32, bfloat16, or auto (bfloat16 on a GPU that supports it)"""
    track: bool = False
    """also log every metric and the evaluation samples to trackio (pip install trackio; `trackio show` to see them)"""
    track_project: str = "tiny-rlhf"
    """the trackio project of --track"""

    # Algorithm specific arguments
    total_steps: int = 80
    """optimizer steps (about one and a half epochs over the built-in pairs; held-out accuracy against steps, and by
    warm-up: docs/results.md#the-preference-family)"""
    batch_size: int = 128
    """examples per optimizer step (KTO: unpaired answers, as many as in dpo.py's 64 pairs)"""
    micro_batch_size: int = 0
    """examples per forward/backward pass, for memory (0: the whole batch); does not change the gradient (KTO: z0 is
    estimated on the whole batch first)"""
    learning_rate: float = 1e-5
    """AdamW learning rate (with beta = 1.0; at beta = 0.1 this rate drifts away from the reference: see departure 5)"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    beta: float = 1.0
    """the KL coefficient: the value function is sigmoid(beta * (r - z0)) with r = log(pi / pi_ref) (dpo.py's: see
    departure 5)"""
    lambda_d: float = 1.0
    """KTO: lambda_D, the weight of desirable examples (the paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3])"""
    lambda_u: float = 1.0
    """KTO: lambda_U, the weight of undesirable examples"""
    dataset: str = ""
    """a local folder (datasets.save_to_disk or .json/.jsonl) or hub id with prompt, completion, label columns (label
    true for desirable, false for undesirable), and optionally answer (default: the built-in pairs, split)"""
    num_eval: int = 500
    """with --dataset: examples held out for evaluation (at most half; split by prompt, never trained on)"""
    num_pair_prompts: int = 4000
    """built-in pairs: training problems to answer"""
    group_size: int = 8
    """built-in pairs: answers sampled per problem, at temperature 1"""
    max_new_tokens: int = 0
    """generation budget of the built-in pairs and of the evaluation (0: the task's own, 8 for addition, 64 for scratchpad)"""

    def __post_init__(self):
        self.output_dir = self.output_dir or f"runs/{self.exp_name}__{self.seed}"
        self.micro_batch_size = self.micro_batch_size or self.batch_size


def check_args(args: Args) -> None:
    """Fail fast with the flag's name, before any expensive work."""
    tasks.check_task_flag(args)
    checks.model_task_and_device(args)
    checks.distributed_flags(args, "batch_size")  # under torchrun each process takes its share of every batch
    for flag in ("beta", "learning_rate", "max_grad_norm", "lambda_d", "lambda_u"):  # KTO: and the lambdas
        checks.flag(args, flag, "must be positive", lambda v: v > 0)
    checks.flag(args, "max_new_tokens", "must be 0 (the task's) or positive", lambda v: v >= 0)
    for flag in ("total_steps", "batch_size", "num_pair_prompts", "eval_every", "num_eval"):
        checks.flag(args, flag, "must be at least 1", lambda v: v >= 1)
    checks.flag(args, "group_size", "needs at least 2 answers per problem to make a pair", lambda v: v >= 2)
    checks.flag(args, "micro_batch_size", "must be 0 (the whole batch) or positive", lambda v: v >= 0)
    if args.batch_size % args.micro_batch_size:
        raise SystemExit(f"--batch-size {args.batch_size} must split into --micro-batch-size {args.micro_batch_size}")
    checks.data_flags(args)
    checks.resume_flags(args)
    checks.output_folders(args)


# ---------------------------------------------------------------------------------------------------------------------
# Algorithm: loss (a pure function of tensors)
# ---------------------------------------------------------------------------------------------------------------------


def compute_reference_point(kl_logps, ref_kl_logps):
    """KTO's z0 (Ethayarajh et al. 2024, §4): KL(pi || pi_ref) estimated on mismatched pairs (x_i, y_j) of the batch,
    max(0, mean of log pi(y_j | x_i) - log pi_ref(y_j | x_i)), detached: a constant of the loss. Inputs: (M,) sequence
    log-probs of the mismatched pairs under the policy and the reference. Returns a scalar."""
    return (kl_logps - ref_kl_logps).mean().clamp(min=0).detach()


def compute_loss(logps, ref_logps, desirable, z0, args):
    """KTO loss (Ethayarajh et al. 2024, §4): lambda_y - v(x, y), averaged over examples, with r = log pi(y | x) -
    log pi_ref(y | x) and v = lambda_D sigmoid(beta (r - z0)) for a desirable y, lambda_U sigmoid(beta (z0 - r)) for an
    undesirable one. logps, ref_logps: (N,) sequence log-probs (sums over completion tokens), the reference ones
    constants; desirable: (N,) bool; z0: a constant (compute_reference_point). Its gradient per example is
    -/+ lambda_y beta sigmoid(s) (1 - sigmoid(s)) grad log pi(y | x), s the sigmoid's argument: largest where r is
    near z0, vanishing far from it on either side."""
    rewards = logps - ref_logps  # KTO: (N,) implicit rewards log(pi / pi_ref), no beta
    values = torch.where(
        desirable,
        args.lambda_d * torch.sigmoid(args.beta * (rewards - z0)),
        args.lambda_u * torch.sigmoid(args.beta * (z0 - rewards)),
    )  # KTO: (N,) v(x, y), gains above z0 for a desirable answer, losses below it for an undesirable one
    losses = torch.where(desirable, args.lambda_d, args.lambda_u) - values  # KTO: (N,) lambda_y - v(x, y)
    with torch.no_grad():  # one sample per example, pooled over micro-batches by common.pool_metrics
        metrics = {
            "loss/kto": losses,  # KTO
            "rewards/desirable": rewards[desirable],  # KTO
            "rewards/undesirable": rewards[~desirable],  # KTO
            "rewards/accuracies": torch.where(desirable, rewards > z0, rewards < z0).float(),  # KTO: on its side of z0
            "kl/z0": z0,  # KTO
        }
    loss = losses.mean()
    return loss, metrics


def sequence_logps(model, prompt_ids, prompt_mask, completion_ids, mask):
    """log pi(y | x) = sum over the completion's valid tokens of log pi(y_t | x, y_<t) (prompt and padding
    excluded). prompt_ids, prompt_mask: (N, P) left-padded; completion_ids, mask: (N, T) right-padded. Returns (N,)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
    logprobs, _ = common.completion_logprobs(model, input_ids, attention_mask, completion_ids.shape[1], 1.0)
    return torch.where(mask, logprobs, 0.0).sum(dim=1)


@torch.no_grad()
def evaluate_examples(model, ref_model, data, ref_logps, args) -> dict:
    """The implicit reward log(pi / pi_ref) on held-out examples (never trained on), against z0 estimated on their own
    mismatched pairs: the fraction on its label's side of z0, the mean rewards of each label, z0 and the KTO loss."""
    idx = torch.arange(len(ref_logps), device=ref_logps.device)
    kl_logps, ref_kl_logps = (logps_no_grad(m, data, idx, idx.roll(1), args.micro_batch_size) for m in (model, ref_model))
    z0 = compute_reference_point(kl_logps, ref_kl_logps)
    chunks = idx.split(args.micro_batch_size)
    rows = [compute_loss(example_logps(model, data, i, i), ref_logps[i], data["desirable"][i], z0, args)[1] for i in chunks]
    return {f"eval/{name.replace('/', '_')}": value.item() for name, value in common.pool_metrics(rows).items()}


@torch.no_grad()
def logps_no_grad(model, data, idx, completion_idx, chunk_size: int):
    """example_logps in chunks, without gradient: the reference's, and the policy's on KTO's mismatched pairs."""
    chunks = zip(idx.split(chunk_size), completion_idx.split(chunk_size))
    return torch.cat([example_logps(model, data, i, j) for i, j in chunks])


def example_logps(model, data, idx, completion_idx):
    """Sequence log-probs (b,) of the completions `completion_idx` after the prompts `idx` (data: tokenize_pairs with
    keys=("completion",)): the examples themselves when completion_idx is idx, mismatched pairs otherwise."""
    prompt = (data["prompt_ids"][idx], data["prompt_mask"][idx])
    return sequence_logps(model, *prompt, data["completion_ids"][completion_idx], data["completion_mask"][completion_idx])


def unpaired_examples(pairs):
    """KTO: each pair as two unpaired examples, (prompt, chosen) labelled desirable and (prompt, rejected) undesirable:
    a data set with prompt, completion, completion_end and label columns."""
    import datasets

    pairs = pairs[:]  # a dict of lists
    rows = {"prompt": pairs["prompt"] * 2, "completion": pairs["chosen"] + pairs["rejected"]}
    rows["completion_end"] = pairs["chosen_end"] + pairs["rejected_end"]
    rows["label"] = [True] * len(pairs["prompt"]) + [False] * len(pairs["prompt"])
    return datasets.Dataset.from_dict(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":
    args = tyro.cli(Args)
    check_args(args)
    device = dist.init_device(args.device)  # auto: CUDA when available; under torchrun, this process's own device
    common.seed_everything(args.seed + dist.rank())  # under torchrun each process draws its own numbers
    task, eval_pairs = None, None  # what the policy is evaluated on: the task's problems, or held-out pairs (--dataset)
    user_pairs = preference_pairs.load_labelled(args.dataset) if args.dataset else None  # KTO: labelled examples
    args.max_new_tokens = args.max_new_tokens or tasks.verifier(args.task)[1]  # the task's budget unless --max-new-tokens
    # the tokenizer first, alone: the prompts are rendered (and a bad one refused) before any weights load
    tokenizer = models.load_tokenizer(args.model_name_or_path, args.cache_dir, args.task)
    if args.dataset:  # a user's pairs, their prompts rendered as the model reads them (--chat-template), some held out
        rendered = preference_pairs.render_prompts(user_pairs, tokenizer, args)
        user_pairs, eval_pairs = preference_pairs.split_held_out(rendered.train, args.num_eval)
        if "answer" in user_pairs.column_names:  # held-out prompts to answer, scored by the task's verifier
            answers = lambda ds: ds.select_columns(["prompt", "answer"]).map(lambda r: {"answer": str(r["answer"]).strip()})
            task = tasks.Task(
                args.task, answers(user_pairs), answers(eval_pairs), *tasks.verifier(args.task), chat=rendered.chat
            )
        pairs, skipped, pairs_time = user_pairs, 0, 0.0
    else:  # the task's problems as the model reads them, and pairs built on them once by the warm-up policy (loaded only
        # then), cached and shared with reward_model.py (pairs_time is 0 from the cache)
        task = tasks.apply_chat_template(tasks.make_task(args.task), tokenizer, args.chat_template, args.instruction)
        dtype = lora.base_dtype(args, device)  # the policy's own: a LoRA base may be bf16 (on a GPU)
        load_policy = lambda: models.load_model_and_tokenizer(
            args.model_name_or_path, args.cache_dir, device, args.task, dtype
        )
        pairs, skipped, pairs_time = preference_pairs.cached_verifier_pairs(args, task, load_policy, device)
    examples = pairs if args.dataset else unpaired_examples(pairs)  # KTO: unpaired, each labelled
    if len(examples) < args.batch_size:
        raise SystemExit(f"only {len(examples)} examples ({skipped} prompts skipped): fewer than --batch-size")
    generated = 0 if args.dataset else args.num_pair_prompts * args.group_size  # responses sampled to build the pairs
    print(f"{len(examples)} examples, {sum(map(bool, examples['label']))} desirable ({skipped} prompts had no pair)")
    policy = models.load_model(
        args.model_name_or_path, args.cache_dir, device, args.task, lora.base_dtype(args, device)
    )  # float32, or with --lora-rank the frozen weights in --lora-base-dtype
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(policy)
    if args.lora_rank:  # train a low-rank adapter on the frozen weights instead of every weight
        policy = lora.add_adapter(policy, args)
    if args.lora_rank:  # KTO: the frozen warm-up, for z0's pairs: the policy with its adapter switched off
        ref_policy = lora.WithoutAdapter(policy)
    else:  # KTO
        ref_policy, _ = models.load_model_and_tokenizer(args.model_name_or_path, args.cache_dir, device, args.task)
        ref_policy.requires_grad_(False)
    # models stay in eval mode throughout: no dropout, so that log pi_ref below is exactly the reference's
    data = preference_pairs.tokenize_pairs(tokenizer, examples[:], device, keys=("completion",))
    data["desirable"] = torch.tensor([bool(label) for label in examples["label"]], device=device)  # KTO: (N,)
    # the reference is the starting policy: its log-probs, once, before any update
    every = torch.arange(len(examples), device=device)
    ref_logps = logps_no_grad(policy, data, every, every, args.micro_batch_size)  # KTO: (N,)
    if eval_pairs is not None:
        eval_data = preference_pairs.tokenize_pairs(tokenizer, eval_pairs[:], device, keys=("completion",))
        eval_data["desirable"] = torch.tensor([bool(label) for label in eval_pairs["label"]], device=device)
        every = torch.arange(len(eval_pairs), device=device)
        ref_eval_logps = logps_no_grad(policy, eval_data, every, every, args.micro_batch_size)

    def evaluate() -> dict:  # the held-out examples (--dataset) and, where there are answers, greedy accuracy
        metrics = evaluate_examples(policy, ref_policy, eval_data, ref_eval_logps, args) if eval_pairs is not None else {}
        return {**metrics, **(common.evaluate(policy, tokenizer, task, args.max_new_tokens) if task else {})}

    policy, ref_policy = dist.prepare_models(args, policy, ref_policy)  # torchrun: rank 0's weights everywhere, or FSDP2
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    checkpoint = run_state.Checkpoint(args, optimizer, generator)  # --resume: restores the run
    # with --resume: appends after that step; under torchrun, pools every row over the processes
    logger = run_state.MetricsLogger(args.output_dir, checkpoint.resumed_step, common.pool_metrics)
    if args.track:  # every logged row to trackio too, with the flags as the run's config
        logger.track(vars(args))
    eval_metrics = logger.last_eval or evaluate()
    pairs_metrics = {
        "data/pairs": 0 if args.dataset else len(pairs),  # KTO: a user's examples come unpaired
        "data/examples": len(examples),  # KTO
        "data/skipped_prompts": skipped,
        "time/pairs": pairs_time,
        "train/responses": generated,
    }
    logger.log(0, {**eval_metrics, **pairs_metrics})
    order = checkpoint.extra.get("order", torch.empty(0, dtype=torch.long))  # the examples left in this epoch

    bar = tqdm(range(checkpoint.step + 1, args.total_steps + 1), args.exp_name, disable=not dist.is_main())
    for step in bar:
        step_start = time.time()
        if len(order) < args.batch_size:  # a new epoch over the examples, in a new order
            order = torch.randperm(len(examples), generator=generator)
        kl_idx = dist.shard(order[: args.batch_size].roll(1)).to(device)  # KTO: the completion before each in the batch
        mb_idx, order = dist.shard(order[: args.batch_size]).to(device), order[args.batch_size :]  # torchrun: a share
        # KTO: z0 on the whole batch's mismatched pairs (x_i, y_{i-1}), before the update and without gradient
        kl_logps, ref_kl_logps = (logps_no_grad(m, data, mb_idx, kl_idx, args.micro_batch_size) for m in (policy, ref_policy))
        z0 = compute_reference_point(dist.concat_over_ranks(kl_logps), dist.concat_over_ranks(ref_kl_logps))

        # -------------------------------------------------------------------------------------------------------------
        # Update: one optimizer step per batch of examples
        # -------------------------------------------------------------------------------------------------------------
        optimizer.zero_grad()
        train_metrics = []
        for idx in mb_idx.split(args.micro_batch_size):
            logps = example_logps(policy, data, idx, idx)  # (b,)
            loss, metrics = compute_loss(logps, ref_logps[idx], data["desirable"][idx], z0, args)  # KTO
            loss = loss * len(idx) / len(mb_idx)  # micro-batches add up to the batch's mean
            common.check_finite(loss, "loss", step)
            loss.backward()
            train_metrics.append(metrics)
        dist.average_gradients(optimizer)  # under torchrun: every gradient becomes its mean over the processes
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        common.check_finite(grad_norm, "gradient norm", step)
        optimizer.step()

        # -------------------------------------------------------------------------------------------------------------
        # Log and evaluate
        # -------------------------------------------------------------------------------------------------------------
        row = common.pool_metrics(train_metrics)
        row.update({"train/grad_norm": grad_norm, "time/step": time.time() - step_start, "train/responses": generated})
        if step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics = evaluate()
            row.update(eval_metrics)
        logger.log(step, row)
        shown = {k: f"{eval_metrics[k]:.2f}" for k in ("eval/accuracy", "eval/rewards_accuracies") if k in eval_metrics}
        bar.set_postfix(loss=f"{row['loss/kto'].item():.3f}", **{k.split("/")[1]: v for k, v in shown.items()})
        # saves every --save-every steps, with the pairs left in this epoch (--resume goes on with them); after Ctrl-C
        # or SIGTERM, saves and exits
        checkpoint.step_done(step, extra={"order": order})

    # -----------------------------------------------------------------------------------------------------------------
    # Save
    # -----------------------------------------------------------------------------------------------------------------
    dist.save_model(policy, tokenizer, os.path.join(args.output_dir, "model"))  # under torchrun: rank 0, gathered
    logger.close()
    checkpoint.close()
    shown = ", ".join(f"{k} {eval_metrics[k]:.3f}" for k in ("eval/accuracy", "eval/rewards_accuracies") if k in eval_metrics)
    print(f"{shown} after {args.total_steps} steps; saved to {args.output_dir}")
