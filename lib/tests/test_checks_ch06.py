"""The chapter 6 checker: the solution passes, each kind of wrong copy-on-write fails the right property."""

import time

from pagedkv import checks


def cow_ok(pool, request_id):
    table = pool.tables[request_id]
    old = table[-1]
    new = pool.allocate_page()
    pool.pages[new].extend(pool.pages[old])
    table[-1] = new
    pool.owners[new].add(request_id)
    pool.drop_owner(old, request_id)
    return new


def verdicts(report):
    return [r.passed for r in report.results]


def test_the_solution_passes_every_property(capsys):
    assert checks.check_copy_on_write(cow_ok)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 6


def test_forgetting_to_copy_the_tokens_fails_the_reads():
    def no_copy(pool, request_id):
        table = pool.tables[request_id]
        old, new = table[-1], pool.allocate_page()
        table[-1] = new
        pool.owners[new].add(request_id)
        pool.drop_owner(old, request_id)
        return new

    report = checks.check_copy_on_write(no_copy)
    assert verdicts(report) == [False, False, False, False, True, False]
    assert "read('b') after b appends: expected [10, 20], got [20]" in report.results[0].detail
    assert "Diagnosis: tokens not copied" in report.results[0].detail


def test_keeping_the_old_owner_reference_fails_check():
    def keeps_owner(pool, request_id):
        table = pool.tables[request_id]
        old, new = table[-1], pool.allocate_page()
        pool.pages[new].extend(pool.pages[old])
        table[-1] = new
        pool.owners[new].add(request_id)
        return new

    report = checks.check_copy_on_write(keeps_owner)
    assert not report.results[0].passed and "every owner entry has a table entry" in report.results[0].detail
    assert "Diagnosis: the old owner reference kept" in report.results[0].detail
    assert not report.results[5].passed


def test_changing_state_before_allocating_fails_out_of_memory():
    def late_allocation(pool, request_id):
        table = pool.tables[request_id]
        old = table[-1]
        pool.drop_owner(old, request_id)  # too early: if allocation fails, b has lost its page
        new = pool.allocate_page()
        pool.pages[new].extend(pool.pages[old])
        table[-1] = new
        pool.owners[new].add(request_id)
        return new

    report = checks.check_copy_on_write(late_allocation)
    assert verdicts(report)[:5] == [True, True, True, True, False]
    assert "the pool changed" in report.results[4].detail
    assert "Diagnosis: state changed before allocating" in report.results[4].detail


def test_writing_in_place_is_caught():
    report = checks.check_copy_on_write(lambda pool, rid: pool.tables[rid][-1])
    assert verdicts(report) == [False] * 6
    assert all("Diagnosis: written in place" in r.detail for r in report.results)


def test_copying_the_first_page_fails_the_three_page_case_by_name():
    def first_page(pool, request_id):
        table = pool.tables[request_id]
        old, new = table[0], pool.allocate_page()
        pool.pages[new].extend(pool.pages[old])
        table[0] = new
        pool.owners[new].add(request_id)
        pool.drop_owner(old, request_id)
        return new

    report = checks.check_copy_on_write(first_page)
    assert verdicts(report) == [True, False, True, True, True, False]
    assert "page 0 was copied, but the partial page is the tail, 2" in report.results[1].detail
    assert "Diagnosis: the wrong page copied" in report.results[1].detail


def test_wrong_return_type_fails_only_that_property():
    def returns_nothing(pool, request_id):
        cow_ok(pool, request_id)

    report = checks.check_copy_on_write(returns_nothing)
    assert verdicts(report) == [True, True, False, True, True, True]
    assert "expected an integer, got NoneType" in report.results[2].detail


def test_a_crash_and_a_hang_become_red_lines():
    report = checks.check_copy_on_write(lambda pool, rid: 1 / 0)
    assert verdicts(report) == [False] * 6
    assert "ZeroDivisionError" in report.results[0].detail

    def hangs(pool, request_id):
        while True:
            time.sleep(0.01)

    start = time.monotonic()
    report = checks.check_copy_on_write(hangs, timeout=0.3)
    assert verdicts(report) == [False] * 6
    assert "no answer within" in report.results[0].detail
    assert time.monotonic() - start < 10


def test_the_stub_prints_one_line(capsys):
    def stub(pool, request_id):
        raise NotImplementedError

    report = checks.check_copy_on_write(stub)
    assert report.stub and len(report.results) == 1
    assert capsys.readouterr().out.count("\n") == 1
