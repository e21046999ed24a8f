"""The project's own rules, checked: each sibling's diff against grpo.py stays within its budget, common.py stays the
small core a learner reads (at most 450 lines), product code holds no test hook, and the README is a front door (at
most 220 lines, every relative link and #anchor resolves, at least five pages of docs/ linked, every page of docs/
reachable). What the pages state is what is measured or generated: diff counts and budgets, the results tables, the
"Measured:" lines of docs/algorithms.md, and pyproject.toml's list of the project's modules."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = sorted(  # every Python file of the project but the tests (and hidden folders: virtual environments)
    os.path.join(folder, name)
    for folder, dirs, names in os.walk(ROOT)
    if not any(
        part not in (".", "") and part.startswith(".") or part in ("tests", "runs", "__pycache__")
        for part in os.path.relpath(folder, ROOT).split(os.sep)
    )
    for name in names
    if name.endswith(".py")
)


BUDGETS = {  # changed lines against grpo.py, at most
    "rloo.py": 50,
    "dr_grpo.py": 40,
    "gspo.py": 40,
    "dapo.py": 140,
    "ppo.py": 240,
    "cispo.py": 68,
    "reinforce_pp.py": 50,
    "sapo.py": 49,
    "maxrl.py": 44,
    "opd.py": 93,
    "grpo_tools.py": 217,
    "grpo_engine.py": 190,
}


def changed_lines(a: str, b: str) -> int:
    """Lines starting with < or > in `diff A B`: what a reader of the diff reads."""
    out = subprocess.run(["diff", a, b], cwd=ROOT, capture_output=True, text=True).stdout
    return sum(line.startswith(("<", ">")) for line in out.splitlines())


@pytest.mark.parametrize("script, budget", BUDGETS.items())
def test_diff_budget_against_grpo(script, budget):
    """A sibling changes grpo.py only where its algorithm differs."""
    changed = changed_lines("grpo.py", script)
    assert 0 < changed <= budget, f"{script}: {changed} changed lines, budget {budget}"


def test_common_is_the_small_core():
    with open(os.path.join(ROOT, "common.py")) as f:
        assert len(f.read().splitlines()) <= 450


def imported_project_modules(path: str) -> set[str]:
    """The project's own top-level modules (a .py file at the root, or plumbing) that the file imports anywhere in it,
    a function's lazy import included."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return {n for n in names if os.path.isfile(os.path.join(ROOT, f"{n}.py")) or n == "plumbing"}


def test_the_import_graph_runs_one_way_scripts_then_common_and_tasks_then_plumbing():
    """A learner can read a script with common.py and tasks.py beside it and skip plumbing/: plumbing imports nothing of
    the project above it, and common.py and tasks.py import only plumbing (the built-in model's warm-up is sft.py run
    as a program, not imported)."""
    plumbing = [p for p in PRODUCT if os.path.dirname(p) == os.path.join(ROOT, "plumbing")]
    assert len(plumbing) >= 5
    for path in plumbing:
        assert imported_project_modules(path) <= {"plumbing"}, path
    for name in ("common.py", "tasks.py"):
        assert imported_project_modules(os.path.join(ROOT, name)) <= {"plumbing"}, name


def test_product_code_reads_no_variable_that_only_tests_set():
    """Environment variables are how a test hook would switch on behaviour in product code. The product reads only
    torchrun's, the cache folder's and the Hugging Face hub's (and the proxies it must not probe through)."""
    allowed = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "TINY_RLHF_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "TQDM_DISABLE"}
    allowed |= {"PYTHONPATH"}  # set by benchmark.py for a script it runs from another folder, read by Python only
    allowed |= {f"{name}_PROXY" for name in ("HTTPS", "HTTP", "ALL")} | {f"{name}_proxy" for name in ("https", "http", "all")}
    assert len(PRODUCT) >= 15 and os.path.join(ROOT, "plumbing", "dist.py") in PRODUCT
    read = set()
    for path in PRODUCT:
        with open(path) as f:
            source = f.read()
        for line in source.splitlines():
            if "environ" in line or "getenv" in line:  # environ.get("X"), environ["X"], {**environ, "X": ...}, for v in (...)
                read |= set(re.findall(r"(?:environ(?:\.get)?|getenv)[\[(]\s*[\"'](\w+)[\"']", line))
                read |= set(re.findall(r"[\"'](\w+)[\"']\s*:", line))
                for names in re.findall(r"for \w+ in \(([^)]*)\)", line):
                    read |= set(re.findall(r"[\"'](\w+)[\"']", names))
    assert read and read <= allowed, read - allowed


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def relative_links(text: str) -> list[str]:
    """The targets of markdown links and images that are not URLs or anchors within the page, without their #anchor."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+://|#|mailto:", t)]


def test_the_readme_is_a_front_door():
    text = readme()
    assert len(text.splitlines()) <= 220
    links = relative_links(text)
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing
    pages = {link for link in links if re.fullmatch(r"docs/[\w-]+\.md", link)}
    assert len(pages) >= 5, pages


def test_every_docs_page_is_reachable_and_its_links_resolve():
    """Each page of docs/ is linked from the README (or from a page that is), and every relative link in it resolves."""
    reachable, todo = set(), ["README.md"]
    while todo:
        page = todo.pop()
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for link in relative_links(text):
            target = os.path.normpath(os.path.join(os.path.dirname(page), link))
            assert os.path.exists(os.path.join(ROOT, target)), f"{page} links to {link}, which does not exist"
            if target.endswith(".md") and target not in reachable:
                reachable.add(target)
                todo.append(target)
    pages = {os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")}
    assert pages <= reachable, pages - reachable


def markdown_tables(text: str) -> list[tuple[tuple[str, ...], list[tuple[str, ...]]]]:
    """Every markdown table in `text` as (header cells, rows of cells), the separator row left out."""
    tables, current = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = tuple(c.strip() for c in line.strip().strip("|").split("|"))
        if current is None:
            current = (cells, [])
            tables.append(current)
        elif not set("".join(cells)) <= set("-: "):
            current[1].append(cells)
    return tables


def markdown_rows(text: str) -> list[dict]:
    """The rows of every markdown table in `text`, each as {header: cell}."""
    return [dict(zip(header, row)) for header, rows in markdown_tables(text) for row in rows]


def end_accuracy_range(generated_row: dict) -> str:
    """A generated table's "end accuracy" cell, "mean ± std (low-high)", as the README quotes it: "low-high%"."""
    low, high = re.search(r"\((\d\.\d+)-(\d\.\d+)\)", generated_row["end accuracy"]).groups()
    return f"{100 * float(low):.1f}-{100 * float(high):.1f}%"


def test_the_readme_results_are_those_of_the_generated_tables():
    """Each row of the README's results table quotes benchmark.py's generated tables of both built-in tasks: the end
    accuracy's min-max over the seeds on each task, and on addition the minutes of the whole command and the responses
    generated; and it covers every script they hold."""
    generated = {}
    for task in ("addition", "scratchpad"):
        with open(os.path.join(ROOT, "docs", task, "results.md")) as f:
            generated[task] = {row["algorithm"]: row for row in markdown_rows(f.read()) if "end accuracy" in row}
    quoted = {
        re.match(r"`(\w+)\.py`", row["script"]).group(1): row
        for row in markdown_rows(readme())
        if "addition: minutes, whole command" in row
    }
    assert quoted.keys() == generated["addition"].keys() == generated["scratchpad"].keys()
    assert len(quoted) == 16  # every script benchmark.py runs
    for name, row in quoted.items():
        for task in ("addition", "scratchpad"):
            assert row[f"{task}: accuracy at the end"] == end_accuracy_range(generated[task][name]), (task, name)
        assert row["addition: minutes, whole command"] == generated["addition"][name]["minutes (command)"], name
        assert row["addition: responses generated"].split(" (")[0] == generated["addition"][name]["responses generated"]


def test_the_readme_first_screen_quotes_the_command_timed_alone():
    """The README's first screen (minutes, start and end accuracy of `python grpo.py --group-size 8` run alone) is the
    row of that command in docs/results.md's table of whole commands timed alone."""
    minutes, start, end = re.search(
        r"alone, it takes ([\d.]+) minutes and the held-out accuracy goes from ([\d.]+%) to ([\d.]+%)",
        " ".join(readme().split()),
    ).groups()
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        (row,) = [r for r in markdown_rows(f.read()) if r.get("command") == "`python grpo.py --group-size 8`"]
    assert (row["minutes"], row["held-out accuracy"]) == (minutes, f"{start} -> {end}")


def test_the_readme_pass_at_k_table_is_that_of_the_generated_tables():
    """The README's MaxRL-against-GRPO table quotes docs/maxrl/<task>/results.md: the end evaluation's greedy accuracy,
    pass@1 and pass@8, cell for cell, for both scripts on both tasks."""
    quoted = [row for row in markdown_rows(readme()) if "pass@8" in row and "task" in row]
    assert len(quoted) == 4
    for row in quoted:
        with open(os.path.join(ROOT, "docs", "maxrl", row["task"], "results.md")) as f:
            generated = [r for r in markdown_rows(f.read()) if r.get("evaluation") == "end"]
        name = re.match(r"`(\w+)\.py`", row["script"]).group(1)
        (end,) = [r for r in generated if r["algorithm"] == name]
        assert [row["greedy accuracy"], row["pass@1"], row["pass@8"]] == [end["greedy accuracy"], end["pass@1"], end["pass@8"]]


def test_the_real_model_pages_quote_the_generated_tables():
    """Every table of docs/real-model.md, and each table of docs/fitting-a-gpu.md and docs/results.md headed like one of
    docs/real-model/results.md, is a table of that generated file, row for row: the pages quote one sitting of
    `python -m benchmarks.benchmark_real_model`, not figures of their own."""
    with open(os.path.join(ROOT, "docs", "real-model", "results.md")) as f:
        generated = markdown_tables(f.read())
    with open(os.path.join(ROOT, "docs", "real-model.md")) as f:
        page = markdown_tables(f.read())
    assert len(page) >= 6
    for header, rows in page:
        assert (header, rows) in generated, f"docs/real-model.md: the table headed {header} is not one of results.md"
    headers = {header for header, _ in generated}
    for name, least in (("fitting-a-gpu.md", 3), ("results.md", 1)):
        with open(os.path.join(ROOT, "docs", name)) as f:
            quoted = [table for table in markdown_tables(f.read()) if table[0] in headers]
        assert len(quoted) >= least, name
        for header, rows in quoted:
            assert (header, rows) in generated, f"docs/{name}: the table headed {header} differs from results.md's"


def test_the_engine_page_quotes_the_generated_tables():
    """The measured tables of docs/engine.md are tables of docs/engine/results.md, row for row: the page quotes
    `python -m benchmarks.benchmark_engine`, not figures of its own."""
    with open(os.path.join(ROOT, "docs", "engine", "results.md")) as f:
        generated = markdown_tables(f.read())
    with open(os.path.join(ROOT, "docs", "engine.md")) as f:
        page = markdown_tables(f.read())
    headers = {header for header, _ in generated}
    quoted = [table for table in page if table[0] in headers]
    assert len(quoted) >= 4
    for header, rows in quoted:
        assert (header, rows) in generated, f"docs/engine.md: the table headed {header} is not one of results.md"


def pages() -> list[str]:
    """README.md and every markdown page under docs/, as paths from the root."""
    found = ["README.md"]
    for folder, _, names in sorted(os.walk(os.path.join(ROOT, "docs"))):
        found += sorted(os.path.relpath(os.path.join(folder, name), ROOT) for name in names if name.endswith(".md"))
    return found


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def test_every_changed_line_count_a_page_states_is_what_its_diff_counts():
    """Wherever a page states "N changed lines", its sentence names the diff (`diff A.py B.py`) and N is what that diff
    counts now, so that an edit of a script cannot leave a stale count behind."""
    for page in pages():
        text = " ".join(read(page).split())
        for m in re.finditer(r"(\d+) changed lines", text):
            diffs = re.findall(r"`diff (\w+\.py) (\w+\.py)`", re.split(r"\.\s", text[: m.start()])[-1])
            assert diffs, f"{page}: {m.group(0)!r} names no `diff A.py B.py` in its sentence"
            a, b = diffs[-1]
            assert int(m.group(1)) == changed_lines(a, b), (
                f"{page}: `diff {a} {b}` counts {changed_lines(a, b)}, not {m.group(1)}"
            )


def test_the_readme_states_every_diff_budget():
    """The README's budgets of changed lines are the tests': every sibling of grpo.py with its budget above, and dpo.py's
    siblings with budgets their diffs stay within (tests/test_preference_family.py holds those)."""
    listed = re.search(r"budget of changed lines \(([^)]*)\)", " ".join(readme().split())).group(1)
    stated = {f"{name}.py": int(n) for name, n in re.findall(r"(\w+) (\d+)", listed)}
    assert {script: n for script, n in stated.items() if script in BUDGETS} == BUDGETS
    family = {script: n for script, n in stated.items() if script not in BUDGETS}
    assert family.keys() == {"ipo.py", "simpo.py", "orpo.py", "kto.py"}
    for script, budget in family.items():
        assert changed_lines("dpo.py", script) <= budget, f"{script}: the README's budget {budget} is below its diff"


def test_pyproject_names_every_module_of_the_project_first_party():
    """ruff's import order: every module at the root, plumbing, benchmarks, and tests/helpers.py (which the tests import
    by name)."""
    listed = re.search(r"known-first-party = \[(.*?)\]", read("pyproject.toml"), re.DOTALL).group(1)
    modules = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")} | {"plumbing", "benchmarks"}
    names = set(re.findall(r'"(\w+)"', listed))
    assert names == modules | {"helpers"}, f"missing: {modules - names}, not modules: {names - modules - {'helpers'}}"


def github_anchor(heading: str) -> str:
    """A heading's #anchor as GitHub writes it: a link's text only, lower case, punctuation other than - and _ dropped,
    spaces as -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def heading_anchors(page: str) -> set[str]:
    """The #anchors of a page's headings, a repeated heading numbered; headings inside code blocks are none."""
    anchors, fenced = set(), False
    for line in read(page).splitlines():
        fenced = fenced != line.startswith("```")
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not fenced:
            anchor = github_anchor(heading.group(1))
            number = sum(a == anchor or re.fullmatch(re.escape(anchor) + r"-\d+", a) is not None for a in anchors)
            anchors.add(f"{anchor}-{number}" if number else anchor)
    return anchors


def test_every_anchor_a_page_links_to_is_a_heading_there():
    checked = 0
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
            path, _, anchor = target.partition("#")
            if not anchor or re.match(r"[a-z]+://", target) or not (path or page).endswith(".md"):
                continue
            linked = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert anchor in heading_anchors(linked), f"{page} links to {target}: no such heading in {linked}"
            checked += 1
    assert checked >= 30


def algorithm_sections() -> dict[str, str]:
    """The sections of docs/algorithms.md by script ("grpo", "rloo", ...): its heading names the script or its diff."""
    sections = {}
    for section in re.split(r"(?m)^### ", read(os.path.join("docs", "algorithms.md")))[1:]:
        heading = section.splitlines()[0]
        sections[re.findall(r"`(?:diff \w+\.py )?(\w+)\.py`", heading)[-1]] = section
    return sections


def test_each_script_of_the_readme_links_its_section():
    """Each row of the README's table of scripts links the script's section of docs/algorithms.md (or, for the reward
    model and the warm-up, which have none, the page that explains them)."""
    anchors = {name: github_anchor(section.splitlines()[0]) for name, section in algorithm_sections().items()}
    rows = [row for row in markdown_rows(readme()) if "what it changes" in row]
    assert len(rows) == len(anchors) + 2
    for row in rows:
        link = re.fullmatch(r"\[`(\w+)\.py`\]\(([\w/.-]+\.md)(?:#([\w-]+))?\)", row["script"])
        assert link, f"the README's row of {row['script']} links no page"
        script, page, anchor = link.groups()
        if script in anchors:
            assert (page, anchor) == ("docs/algorithms.md", anchors[script]), row["script"]


def test_each_rl_section_quotes_its_real_model_row():
    """Every RL script with a row in the real-model effects page (docs/real-model/effects.md, written by
    benchmark_effects.py) has its held-out accuracy there, first -> last, quoted in its section's "Measured:" line, with a
    link to the page."""
    rows = markdown_rows(read(os.path.join("docs", "real-model", "effects.md")))
    measured = {}
    for row in rows:
        cell = row.get("held-out accuracy, steps 0, 8, 16", "")
        if "->" in cell:
            accuracies = cell.split(" -> ")
            measured[re.match(r"`(\w+)\.py`", row["script"]).group(1)] = f"{accuracies[0]} -> {accuracies[-1]}"
    assert len(measured) >= 11
    sections = algorithm_sections()
    for script, quoted in measured.items():
        text = " ".join(sections[script].split("**Measured:**")[1].split("\n\n")[0].split())
        assert "(real-model/effects.md#every-rl-script)" in text and quoted in text, (script, quoted)


def test_the_effects_page_quotes_the_headline_tables_of_the_records():
    """Each headline table of docs/effects.md (headed | measure | `grpo.py` | `X.py` |) and its preference table are, row
    for row, the ones that benchmark_effects.py writes from the run records kept in docs/real-model/effects-runs: the
    page quotes the benchmark, not figures of its own."""
    from benchmarks import benchmark_effects

    args = benchmark_effects.Args(docs_dir=os.path.join(ROOT, "docs", "real-model"))
    generated = markdown_tables(
        "\n".join(benchmark_effects.headline_section(args) + benchmark_effects.preference_section(args))
    )
    tables = markdown_tables(read(os.path.join("docs", "effects.md")))
    quoted = [table for table in tables if table[0][0] == "measure" or "held-out preference" in table[0][1]]
    assert len(quoted) >= 3
    for table in quoted:
        assert table in generated, f"docs/effects.md: the table headed {table[0]} is not what the records give"


def test_each_algorithm_section_states_what_was_measured():
    """Every section of docs/algorithms.md has a "Measured:" line with a link to its measurement; for a script of the
    benchmark's tables it quotes their end accuracies on both built-in tasks, as the README's results table does."""
    generated = {}
    for task in ("addition", "scratchpad"):
        rows = markdown_rows(read(os.path.join("docs", task, "results.md")))
        generated[task] = {row["algorithm"]: row for row in rows if "end accuracy" in row}
    sections = algorithm_sections()
    assert len(sections) == 18 and set(generated["addition"]) < set(sections)
    for script, section in sections.items():
        assert "**Measured:**" in section, script
        measured = " ".join(section.split("**Measured:**")[1].split("\n\n")[0].split())
        assert re.search(r"\]\([\w/.-]+\.md(#[\w-]+)?\)", measured), script
        if script in generated["addition"]:
            for task in ("addition", "scratchpad"):
                assert f"{task} {end_accuracy_range(generated[task][script])}" in measured, (script, task)
