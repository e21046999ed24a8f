"""benchmark.py's bookkeeping on hand-made metrics (no training, no matplotlib)."""

from benchmarks import benchmark


def run(accuracies, minutes_per_eval=1.0, responses_per_eval=100):
    """Rows like a script's metrics.jsonl: an evaluation at step 0, then training steps with evaluations."""
    rows = [{"step": 0, "eval/accuracy": accuracies[0]}]
    for i, acc in enumerate(accuracies[1:], start=1):
        rows.append(
            {
                "step": i,
                "time/elapsed": 60 * minutes_per_eval * i,
                "time/step": 0.5 * i,
                "train/responses": responses_per_eval * i,
                "rollout/all_correct_frac": 0.25,
                "rollout/all_wrong_frac": 0.5,
                "eval/accuracy": acc,
            }
        )
    return rows


def test_minutes_to_accuracy():
    rows = run([0.5, 0.8, 0.92, 0.85, 0.95])
    assert benchmark.minutes_to(rows, 0.9) == 2.0  # the first evaluation at or above the bar, not a later one
    assert benchmark.minutes_to(rows, 0.5) == 0.0  # the step-0 evaluation counts, at minute 0
    assert benchmark.minutes_to(rows, 0.99) is None


def test_responses_to_accuracy():
    rows = run([0.5, 0.8, 0.92, 0.85, 0.95], responses_per_eval=256)
    assert benchmark.responses_to_reach(rows, 0.9) == 512  # the first evaluation at or above the bar, not a later one
    assert benchmark.responses_to_reach(rows, 0.5) == 0  # the step-0 evaluation, before any response
    assert benchmark.responses_to_reach(rows, 0.99) is None


def test_an_algorithm_with_fewer_seeds_is_named_with_them():
    assert benchmark.name_with_seeds("grpo", [1, 2, 3], [1, 2, 3]) == "grpo"
    assert benchmark.name_with_seeds("cispo", [1], [1, 2, 3]) == "cispo (seed 1)"
    assert benchmark.name_with_seeds("sapo", [1, 3], [1, 2, 3]) == "sapo (seeds 1, 3)"


def test_summary_table_statistics():
    results = {"a": [run([0.5, 0.9, 1.0]), run([0.7, 0.8, 0.8])], "b": [run([0.5, 0.6])]}
    lines = benchmark.summary_table(results, 0.9).splitlines()
    a = [c.strip() for c in lines[2].strip("|").split("|")]
    b = [c.strip() for c in lines[3].strip("|").split("|")]
    assert a[0] == "a" and b[0] == "b" and "| minutes to 90% |" in lines[0]
    assert a[1] == "0.600 ± 0.100 (0.500-0.700)"  # start: mean, population std, range over seeds
    assert a[2] == "0.900 ± 0.100 (0.800-1.000)"
    assert a[3] == "-"  # no whole-command time recorded for these runs
    assert a[4] == "2.0 (2.0-2.0)"  # training minutes at the last row: mean (range)
    assert a[5] == "not reached"  # one seed never reaches 90%
    assert a[6] == "100 / -"  # each seed's responses generated when it first reached 90%
    assert a[7] == "0.75"  # median of all step times (0.5, 1.0, 0.5, 1.0)
    assert a[8] == "200"
    results = {"a": [run([0.5, 0.9, 1.0]), run([0.5, 0.5, 0.95], minutes_per_eval=2.0)]}
    results["a"][0][0]["time/command"], results["a"][1][0]["time/command"] = 150.0, 300.0
    a = [c.strip() for c in benchmark.summary_table(results, 0.9).splitlines()[2].strip("|").split("|")]
    assert a[3] == "3.8 (2.5-5.0)" and a[4] == "3.0 (2.0-4.0)" and a[5] == "2.5 (1.0-4.0)" and a[6] == "100 / 200"


def test_rlhf_summary_reports_the_best_gold_evaluation_and_the_proxy():
    """The per-response KL is kl/ref (a mean over tokens) times the mean response length; the summary names the best
    held-out evaluation and its step, and the proxy and gold of the first and last ten steps."""
    assert benchmark.response_kl({"kl/ref": 0.05, "rollout/response_length": 4.0}) == 0.2  # exactly: 4 fl(0.05) = fl(0.2)
    rm = [{"step": 0, "data/pairs": 900, "data/eval_pairs": 100, "eval/pairwise_accuracy": 0.5, "time/command": 120.0}]
    rm += [{"step": 20, "eval/pairwise_accuracy": 0.82}, {"step": 40, "eval/pairwise_accuracy": 0.8}]
    ppo = [{"step": 0, "eval/accuracy": 0.5}]
    for step in range(1, 31):
        row = {"step": step, "rollout/reward_mean": step / 10, "rollout/gold_accuracy": 0.5, "kl/ref": 0.1}
        row["rollout/response_length"] = 2.0
        if step % 10 == 0:
            row["eval/accuracy"] = {10: 0.7, 20: 0.6, 30: 0.55}[step]
        ppo.append(row)
    lines = benchmark.rlhf_summary(rm, {0.5: ppo}).splitlines()
    assert "900 training pairs, 100 held out" in lines[0] and "0.500 -> 0.800 (best 0.820)" in lines[0]
    assert "2.0 minutes" in lines[0] and "- minutes" in lines[1]
    assert "--beta 0.5: gold held-out accuracy 0.500 at the start, best 0.700 at step 10, 0.550 at step 30" in lines[1]
    assert "0.550 at the start, 2.550 at the end" in lines[2]  # steps 1-10 and 21-30: means 0.55 and 2.55
    assert "0.200 nats" in lines[2]


def test_pass_at_k_table_lists_greedy_accuracy_beside_each_k_at_start_and_end():
    with_pass = [run([0.5, 0.9]), run([0.7, 0.8])]
    for rows, (first, last) in zip(with_pass, [(0.25, 0.5), (0.75, 1.0)]):
        rows[0].update({"eval/pass@1": first, "eval/pass@2": first + 0.125})
        rows[-1].update({"eval/pass@1": last, "eval/pass@2": last})
    lines = benchmark.pass_at_k_table({"a": with_pass, "b": [run([0.5, 0.6])]}).splitlines()
    assert lines[0] == "| algorithm | evaluation | greedy accuracy | pass@1 | pass@2 |"
    assert lines[2] == "| a | start | 0.600 (0.500-0.700) | 0.500 (0.250-0.750) | 0.625 (0.375-0.875) |"
    assert lines[3] == "| a | end | 0.850 (0.800-0.900) | 0.750 (0.500-1.000) | 0.750 (0.500-1.000) |"
    assert len(lines) == 4  # "b" logged no pass@k: left out
    assert benchmark.pass_at_k_table({"b": [run([0.5, 0.6])]}) == ""


def test_every_run_of_a_chart_has_its_own_colour():
    """The RL scripts one hue each, the preference family dashed, and the runs of --tools (no script of ALGORITHMS)
    hues of their own rather than one shared black."""
    rl = [a for a in benchmark.ALGORITHMS if a not in benchmark.PREFERENCE]
    assert len({benchmark.line_style(a)["color"] for a in rl}) == len(rl)
    assert benchmark.line_style("cispo (seed 1)") == benchmark.line_style("cispo")
    assert benchmark.line_style("dpo")["linestyle"] == "--"
    tools = list(benchmark.TOOL_RUNS)
    assert len({benchmark.line_style(name, tools)["color"] for name in tools}) == len(tools) == 3


def test_an_accuracy_chart_never_averages_two_starts():
    """One grey start line when every run starts alike; else one line per distinct start, never their mean (grpo_tools.py
    starts at 2.8% with its calculator, grpo.py at 0.2% without)."""
    same = {"grpo": [run([0.5, 0.9]), run([0.5, 0.8])], "maxrl": [run([0.5, 0.95])]}
    assert benchmark.start_lines(same) == [(0.5, "start (warm-up): 50.0%", "gray")]
    tools = {"grpo_tools": [run([0.028, 0.99])], "grpo.py (no tools)": [run([0.002, 0.004])]}
    lines = benchmark.start_lines(tools)
    assert [(start, label) for start, label, _ in lines] == [
        (0.028, "start of grpo_tools: 2.8%"),
        (0.002, "start of grpo.py (no tools): 0.2%"),
    ]
    assert lines[0][2] != lines[1][2]
