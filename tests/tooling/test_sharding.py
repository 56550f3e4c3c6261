"""``--shard`` and ``--only-listed`` (tests/sharding.py, hooked in by conftest.py).

The packing is checked directly; the hooks (the ones conftest.py imports) in
pytest subprocesses collecting three small files in a scratch directory, one of
them absent from its cost table (collection only: no test is run).
"""

import json
import os

import pytest

import sharding

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pack_partitions_largest_first_onto_the_lightest_shard():
    costs = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 3.0, "e": 1.0}
    assert sharding.pack(costs, 2) == [["a", "d"], ["b", "c", "e"]]
    assert sharding.pack(costs, 2) == sharding.pack(dict(reversed(costs.items())), 2)
    # 5 seconds already on shard 1: it takes the smaller files.
    assert sharding.pack(costs, 2, preload=[5.0, 0.0]) == [["b", "e"], ["a", "c", "d"]]
    assert sharding.pack(costs, 7)[5:] == [[], []]
    for n in (1, 2, 3, 7):
        shards = sharding.pack(costs, n)
        assert sorted(sum(shards, [])) == sorted(costs)


def test_the_checked_in_table_is_a_partitionable_cost_table():
    files, per_test = sharding.load_costs()
    assert files and per_test > 0
    assert all(os.path.basename(path).startswith("test_") and os.path.exists(os.path.join(HERE, "..", path))
               for path in files), "shard_costs.json lists a file that is gone: regenerate it"
    shards = sharding.pack(files, 2)
    assert sorted(shards[0] + shards[1]) == sorted(files)


def test_a_file_missing_from_the_table_costs_its_test_count():
    costs = sharding.file_costs({"tests/test_old.py": 3, "tests/test_new.py": 4},
                                {"tests/test_old.py": 10.0}, per_test=2.0)
    assert costs == {"tests/test_old.py": 10.0, "tests/test_new.py": 8.0}


@pytest.mark.parametrize("text", ["2", "0/2", "3/2", "a/b", "1/0"])
def test_a_bad_shard_is_refused(text):
    with pytest.raises(ValueError, match="--shard"):
        sharding.parse_shard(text)


def test_entries_select_whole_node_id_parts():
    assert sharding.matches("tests/test_a.py::test_x[1]", "tests/test_a.py")
    assert sharding.matches("tests/test_a.py::test_x[1]", "tests/test_a.py::test_x")
    assert sharding.matches("tests/test_a.py::test_x[1]", "tests/test_a.py::test_x[1]")
    assert not sharding.matches("tests/test_a.py::test_xy", "tests/test_a.py::test_x")
    assert not sharding.matches("tests/test_ab.py::test_x", "tests/test_a.py")
    keep, unused = sharding.select_listed(["f.py::a", "f.py::b", "g.py::a"], ["f.py::a", "h.py"])
    assert keep == [True, False, False] and unused == ["h.py"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A conftest taking conftest.py's sharding hooks, three test files and a cost table."""
    root = tmp_path_factory.mktemp("shards")
    tests = root / "tests"
    tests.mkdir()
    hooks = [line.strip().rstrip(",") for line in open(os.path.join(HERE, "conftest.py"))
             if line.strip().startswith("pytest_")]
    assert len(hooks) == 5, hooks
    (tests / "conftest.py").write_text(f"from sharding import {', '.join(hooks)}\n")
    for name, n in (("test_big", 6), ("test_mid", 2), ("test_new", 3)):
        body = "".join(f"def test_{i}():\n    pass\n\n" for i in range(n))
        (tests / f"{name}.py").write_text(body)
    table = {"files": {"tests/test_big.py": 9.0, "tests/test_mid.py": 8.0},
             "tests": {"tests/test_big.py": 6, "tests/test_mid.py": 2}}
    (root / "costs.json").write_text(json.dumps(table))
    (root / "floor.txt").write_text("# a comment\ntests/test_big.py::test_1\ntests/test_new.py  # whole file\n")
    return root


class Collected:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]


def collect(root, capsys, *args):
    """Collect the scratch suite in this process: (exit status, node ids, printed text)."""
    capsys.readouterr()
    plugin = Collected()
    status = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                          "--shard-costs", str(root / "costs.json"), str(root / "tests"), *args],
                         plugins=[plugin])
    out, err = capsys.readouterr()
    return status, getattr(plugin, "ids", []), out + err


def test_shards_partition_the_suite_and_keep_unlisted_files(scratch, capsys):
    _, whole, _ = collect(scratch, capsys)
    assert len(whole) == 11
    one, first, _ = collect(scratch, capsys, "--shard", "1/2")
    two, second, text = collect(scratch, capsys, "--shard", "2/2")
    assert one == two == 0
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(whole)
    # test_new.py is not in the table: 3 tests at the table's mean (17 s / 8 tests) = 6.4 s,
    # so big (9) -> shard 1, mid (8) -> shard 2, new -> shard 2.
    assert {i.split("::")[0] for i in second} == {"tests/test_mid.py", "tests/test_new.py"}
    assert "guessed from test counts: tests/test_new.py" in text
    # 10 s of other work on shard 1: it gets the smallest file only.
    _, first, _ = collect(scratch, capsys, "--shard", "1/2", "--shard-preload", "10,0")
    assert {i.split("::")[0] for i in first} == {"tests/test_new.py"}


def test_only_listed_keeps_the_listed_tests_and_refuses_a_stale_entry(scratch, capsys):
    status, ids, text = collect(scratch, capsys, "--only-listed", str(scratch / "floor.txt"))
    assert status == 0, text
    assert ids == ["tests/test_big.py::test_1"] + [f"tests/test_new.py::test_{i}" for i in range(3)]
    (scratch / "stale.txt").write_text("tests/test_big.py::test_9\n")
    status, _, text = collect(scratch, capsys, "--only-listed", str(scratch / "stale.txt"))
    assert status == pytest.ExitCode.USAGE_ERROR and "select no collected test: tests/test_big.py::test_9" in text


def test_only_listed_lenient_runs_what_it_finds_and_fails_at_the_end(scratch, capsys):
    """The GPU check's form: a stale entry does not stop the run; the listed tests that exist run, the stale entry is
    named at the end and the session fails."""
    (scratch / "half_stale.txt").write_text("tests/test_big.py::test_9\ntests/test_mid.py\n")
    capsys.readouterr()
    status = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(scratch), "--shard-costs",
                          str(scratch / "costs.json"), str(scratch / "tests"), "--only-listed",
                          str(scratch / "half_stale.txt"), "--only-listed-lenient"])
    text = "".join(capsys.readouterr())
    assert status == pytest.ExitCode.TESTS_FAILED, text
    assert "2 passed" in text
    assert "FAILED (lenient) --only-listed" in text and "select no collected test: tests/test_big.py::test_9" in text
