"""Chapter 3's decision checkers: free_blocks, free_request and touch inside a real KVCacheManager.

The solution passes; each common mistake fails with its named diagnosis.
"""

from pagedkv import checks


def verdicts(report):
    return [r.passed for r in report.results]


def free_blocks(pool, ordered_blocks):
    first, last = [], []
    for block in ordered_blocks:
        if block.is_null:
            continue
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            (first if block.block_hash is None else last).append(block)
    pool.free_block_queue.prepend_n(first)
    pool.free_block_queue.append_n(last)


def free_request(pool, req_blocks):
    free_blocks(pool, reversed(req_blocks))


def touch(pool, blocks):
    for block in blocks:
        if block.ref_cnt == 0:
            pool.free_block_queue.remove(block)
        block.ref_cnt += 1


def stub(*args):
    raise NotImplementedError


def test_the_solutions_pass(capsys):
    assert checks.check_free_blocks(free_blocks, free_request)
    assert checks.check_touch(touch)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 4 + 2


def test_stubs_print_one_line(capsys):
    for report in (checks.check_free_blocks(stub, stub), checks.check_touch(stub)):
        assert report.stub and len(report.results) == 1
    assert capsys.readouterr().out.count("\n") == 2


def test_append_instead_of_prepend_is_named():
    def appends(pool, ordered_blocks):
        first, last = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        pool.free_block_queue.append_n(first)
        pool.free_block_queue.append_n(last)

    report = checks.check_free_blocks(appends, lambda p, b: appends(p, reversed(b)))
    assert not report.results[0].passed
    assert "Diagnosis: unhashed blocks appended" in report.results[0].detail
    assert "Diagnosis: unhashed blocks appended" in report.results[3].detail


def test_prepending_one_at_a_time_is_a_reversed_batch():
    def one_by_one(pool, ordered_blocks):
        last = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    pool.free_block_queue.prepend_n([block])
                else:
                    last.append(block)
        pool.free_block_queue.append_n(last)

    report = checks.check_free_blocks(one_by_one, free_request)
    assert not report.results[0].passed
    assert "Diagnosis: reversed batch" in report.results[0].detail


def test_hashed_blocks_at_the_head_are_named():
    def hashed_first(pool, ordered_blocks):
        first, last = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        pool.free_block_queue.prepend_n(first)
        pool.free_block_queue.prepend_n(last)

    report = checks.check_free_blocks(hashed_first, free_request)
    assert "Diagnosis: hashed blocks prepended" in report.results[0].detail


def test_queueing_the_null_block_is_caught():
    def no_null_test(pool, ordered_blocks):
        first = []
        for block in ordered_blocks:
            block.ref_cnt -= 1 if not block.is_null else -1  # null: ref_cnt is 0, pretend it dropped
            if block.ref_cnt <= 0 or block.is_null:
                block.ref_cnt = 0
                first.append(block)
        pool.free_block_queue.prepend_n(first)

    report = checks.check_free_blocks(no_null_test, free_request)
    assert not report.results[1].passed
    assert "Diagnosis: the null block queued" in report.results[1].detail


def test_forgetting_reversed_is_named():
    report = checks.check_free_blocks(free_blocks, free_blocks)
    assert verdicts(report) == [True, True, False, False]
    assert "Diagnosis: forgot reversed" in report.results[2].detail
    assert "Diagnosis: forgot reversed" in report.results[3].detail


def test_forgetting_the_touch_is_named():
    def no_remove(pool, blocks):
        for block in blocks:
            block.ref_cnt += 1

    report = checks.check_touch(no_remove)
    assert verdicts(report) == [False, False]
    assert all("Diagnosis: forgot the touch" in r.detail for r in report.results)


def test_raising_only_free_blocks_is_named():
    def only_free(pool, blocks):
        for block in blocks:
            if block.ref_cnt == 0:
                pool.free_block_queue.remove(block)
                block.ref_cnt += 1

    report = checks.check_touch(only_free)
    assert verdicts(report) == [False, False]
    assert "Diagnosis: only free blocks counted" in report.results[0].detail


def test_removing_held_blocks_is_named():
    def always_remove(pool, blocks):
        for block in blocks:
            pool.free_block_queue.remove(block)
            block.ref_cnt += 1

    report = checks.check_touch(always_remove)
    assert not report.results[0].passed
    assert "Diagnosis: removed a block that is not queued" in report.results[0].detail
