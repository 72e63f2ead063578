"""Hints and diagnoses that teach, in exercises 5, 6 and 8 (issue 36 §5).

* Hint 3 is either a partial skeleton (titled so, its code leaves something
  out, ``...``, and holds at most half of the lines of the solution's body)
  or, the form issue 45 asks for, the idea and the invariant to hold: titled
  so, prose with no code block, naming an invariant.
* A diagnosis names the mistake and the invariant it breaks, never the line
  that fixes it: no string in a checker module holds a line of a solution's
  body.
* An exercise never imports the function it asks the reader to write.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "lib" / "pagedkv" / "checks"

#: notebook -> (the functions the reader writes, the checker modules that judge them)
EXERCISES = {
    "05_slot_mapping": (("gather_block_tables", "slot_mapping_gathered", "slot_mapping",
                         "slot_mapping_kernel", "kv_write", "kv_write_kernel", "table_gather_kernel",
                         "gather_block_tables_triton"),
                        ("ch05_slot_mapping", "slot_mistakes", "ch05_tasks", "ch05_gather")),
    "06_copy_on_write": (("copy_on_write", "get_computed_blocks", "can_allocate",
                          "partial_hit", "blocks_to_allocate", "redirect_partial_hit"),
                         ("ch06_copy_on_write", "ch06_prefix_lookup", "ch06_capacity",
                          "ch06_partial_hit", "ch06_copy_prediction", "ch06_designs")),
    "08_serving_engine": (("allocate_with_preemption", "update_block_table",
                           "tokens_this_step", "fan_out", "blocks_in_use", "diagnose",
                           "choose_victim", "make_room_fixed"),
                          ("ch08_serving_engine", "ch08_engine_tasks", "ch08_fan_out",
                           "ch08_diagnose", "ch08_tasks", "ch08_victims", "ch08_find_bug")),
}


def _cells(folder: str, name: str) -> list[dict]:
    return json.loads((ROOT / folder / f"{name}.ipynb").read_text())["cells"]


def _normal(line: str) -> str:
    line = re.sub(r"\s+#.*$", "", line).strip()
    return re.sub(r"\s+", " ", line)


def _body_lines(name: str, functions) -> dict[str, list[str]]:
    """Each solution function's body, one normalised statement line each (no docstring, no comments)."""
    out = {}
    for cell in _cells("solutions", name):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in functions:
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]
                got = []
                for stmt in body:
                    for ln in lines[stmt.lineno - 1: stmt.end_lineno]:
                        ln = _normal(ln)
                        if ln and not ln.startswith(("#", "else", "try", "except", "pass", "break")):
                            got.append(ln)
                out[node.name] = got
    return out


def _hint3_code(name: str) -> list[str]:
    blocks = []
    for cell in _cells("exercises", name):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and "<summary>Hint 3" in text:
            blocks.append(text.split("<summary>Hint 3", 1)[1])
    return blocks


SKELETON, IDEA = " (a partial skeleton)</summary>", " (the idea and the invariant)</summary>"


@pytest.mark.parametrize("name", list(EXERCISES))
def test_every_hint_3_is_a_partial_skeleton_or_the_idea_and_its_invariant(name):
    blocks = _hint3_code(name)
    assert blocks, "no Hint 3 found"
    for block in blocks:
        assert block.startswith((SKELETON, IDEA)), block[:60]
        if block.startswith(IDEA):
            third = block.split("</details>", 1)[0]
            assert "```" not in third and "invariant" in third, third
            continue
        code = block.split("```python", 1)[1].split("```", 1)[0]
        assert "..." in code, f"a Hint 3 that leaves nothing out:\n{code}"


@pytest.mark.parametrize("name", list(EXERCISES))
def test_no_hint_3_holds_most_of_a_solution(name):
    functions, _ = EXERCISES[name]
    bodies = _body_lines(name, functions)
    hints = [{_normal(ln) for ln in (b.split("```python", 1)[1].split("```", 1)[0] if "```python" in b
                                     else b.split("</details>", 1)[0]).splitlines()}
             for b in _hint3_code(name)]
    for fn, lines in bodies.items():
        for hint in hints:
            shared = [ln for ln in lines if ln in hint]
            assert len(shared) * 2 <= len(lines), (fn, shared)


def _strings(module: str) -> list[str]:
    tree = ast.parse((CHECKS / f"{module}.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            found.append("".join(v.value for v in node.values
                                 if isinstance(v, ast.Constant) and isinstance(v.value, str)))
    return found


@pytest.mark.parametrize("name", list(EXERCISES))
def test_no_diagnosis_hands_over_a_line_of_the_solution(name):
    functions, modules = EXERCISES[name]
    lines = {ln for body in _body_lines(name, functions).values() for ln in body
             if len(ln) >= 16 and not ln.startswith(("return", "def ", "for ", "if ", "while "))}
    texts = [_normal(s) for m in modules if (CHECKS / f"{m}.py").exists() for s in _strings(m)]
    handed = sorted({ln for ln in lines for t in texts if ln in t})
    assert not handed, handed


def test_the_copy_on_write_diagnosis_no_longer_hands_over_the_copy():
    texts = " ".join(_strings("ch06_copy_on_write"))
    assert "pool.pages[new].extend(pool.pages[old])" not in texts


@pytest.mark.parametrize("name", list(EXERCISES))
def test_no_exercise_imports_what_it_asks_for(name):
    functions, _ = EXERCISES[name]
    library_answers = {"allocate_with_preemption": "preempt_last_running"}
    for cell in _cells("exercises", name):
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = {a.asname or a.name for a in node.names}
                for fn in functions:
                    assert fn not in names and library_answers.get(fn) not in names, (name, fn)
