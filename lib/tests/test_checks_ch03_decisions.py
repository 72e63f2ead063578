"""Chapter 3's decision checkers: free_blocks, free_request, touch, get_new_blocks and
find_longest_cache_hit inside a real KVCacheManager.

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


# ------------------------------------ get_new_blocks, find_longest_cache_hit
import pytest  # noqa: E402


def get_new_blocks(pool, n):
    queue = pool.free_block_queue
    if n > queue.num_free_blocks:
        raise ValueError(f"Cannot get {n} free blocks from the pool")
    blocks = queue.popleft_n(n)
    for block in blocks:
        h = block.block_hash
        if h is not None:
            same_hash = pool.cached_block_hash_to_block[h]
            del same_hash[block.block_id]
            if not same_hash:
                del pool.cached_block_hash_to_block[h]
            block.reset_hash()
        block.ref_cnt = 1
    return blocks


def find_longest_cache_hit(pool, block_hashes, num_tokens, block_size):
    blocks = []
    for i, h in enumerate(block_hashes):
        if (i + 1) * block_size > num_tokens - 1:
            break
        block = pool.get_cached_block(h)
        if block is None:
            break
        blocks.append(block)
    return blocks


def test_the_new_solutions_pass(capsys):
    assert checks.check_get_new_blocks(get_new_blocks)
    assert checks.check_find_longest_cache_hit(find_longest_cache_hit)
    out = capsys.readouterr().out
    assert "\u274c" not in out and out.count("\u2705") == 5 + 3


def test_the_new_stubs_print_one_line(capsys):
    for report in (checks.check_get_new_blocks(stub),
                   checks.check_find_longest_cache_hit(stub)):
        assert report.stub and len(report.results) == 1
    assert capsys.readouterr().out.count("\n") == 2


def _getter(*, evict="both", whole_entry=False, check=True, words=True,
            tail=False, ref=True):
    def fn(pool, n):
        queue = pool.free_block_queue
        if check and n > queue.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool"
                             if words else f"only {queue.num_free_blocks}")
        if tail:
            blocks = queue.get_all_free_blocks()[::-1][:n]
            for block in blocks:
                queue.remove(block)
        else:
            blocks = queue.popleft_n(n)
        for block in blocks:
            h = block.block_hash
            if h is not None:
                if evict in ("both", "map"):
                    same_hash = pool.cached_block_hash_to_block[h]
                    if whole_entry:
                        same_hash.clear()
                    else:
                        del same_hash[block.block_id]
                    if not same_hash:
                        del pool.cached_block_hash_to_block[h]
                if evict in ("both", "block"):
                    block.reset_hash()
            if ref:
                block.ref_cnt = 1
        return blocks
    return fn


@pytest.mark.parametrize("fn, name", [
    (_getter(tail=True), "popped from the tail"),
    (_getter(evict="none"), "hash kept"),
    (_getter(evict="block"), "cache entry kept"),
    (_getter(evict="map"), "hash not reset"),
    (_getter(whole_entry=True), "every block under the hash dropped"),
    (_getter(ref=False), "ref_cnt not set"),
    (_getter(words=False), "the refusal does not name the count"),
])
def test_each_get_new_blocks_mistake_is_named(fn, name):
    report = checks.check_get_new_blocks(fn, seeds=4)
    failed = [r for r in report.results if not r.passed]
    assert failed and f"Diagnosis: {name}" in failed[0].detail


def test_refusing_after_popping_is_named():
    def pops_then_refuses(pool, n):
        blocks = []
        for _ in range(n):
            if not pool.free_block_queue.num_free_blocks:
                raise ValueError(f"Cannot get {n} free blocks from the pool")
            blocks.append(pool.free_block_queue.popleft())
            blocks[-1].ref_cnt = 1
        return get_new_blocks(pool, 0) or blocks

    report = checks.check_get_new_blocks(pops_then_refuses, seeds=2)
    assert not report.results[3].passed
    assert "Diagnosis: refused after changing the pool" in (
        report.results[3].detail)


def test_leaving_the_refusal_to_the_queue_passes():
    # The queue's own popleft_n refuses before any change, naming the count.
    assert checks.check_get_new_blocks(_getter(check=False), seeds=2)


def _finder(*, cap=-1, skip=False, touch=False, pair=False):
    def fn(pool, block_hashes, num_tokens, block_size):
        blocks = []
        for i, h in enumerate(block_hashes):
            if (i + 1) * block_size > num_tokens + cap:
                break
            block = pool.get_cached_block(h)
            if block is None:
                if skip:
                    continue
                break
            blocks.append(block)
        if touch:
            pool.touch(blocks)
        return (blocks, len(blocks) * block_size) if pair else blocks
    return fn


@pytest.mark.parametrize("fn, passed, name", [
    (_finder(cap=0), [False, True, False], "no -1 cap"),
    (_finder(cap=-4), [False, True, False], "one block too few"),
    (_finder(skip=True), [False, True, None],
     "did not stop at the first miss"),
    (_finder(touch=True), [None, False, False],
     "the lookup touched the blocks"),
    (_finder(pair=True), [False, True, False],
     "returned (blocks, num_tokens)"),
])
def test_each_cache_hit_mistake_is_named(fn, passed, name):
    report = checks.check_find_longest_cache_hit(fn, seeds=6)
    got = verdicts(report)
    assert all(p is None or p == g for p, g in zip(passed, got))
    failed = [r for r in report.results if not r.passed]
    assert failed and all(f"Diagnosis: {name}" in r.detail for r in failed)


# ------------------------------------------------------------- issue 36
def test_freeing_the_null_block_without_the_null_rule_is_caught():
    # vLLM's loop without its `if block.is_null: continue`: the null block's
    # ref_cnt goes from 0 to -1 and it is never queued, which the pool's
    # queue alone does not show.
    def no_null_rule(pool, ordered_blocks):
        first, last = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        pool.free_block_queue.prepend_n(first)
        pool.free_block_queue.append_n(last)

    report = checks.check_free_blocks(no_null_rule, free_request)
    assert verdicts(report) == [True, False, True, True]
    assert "freeing the null block took its ref_cnt to -1" in report.results[1].detail
    assert "Diagnosis: the null block's ref_cnt changed" in report.results[1].detail


def test_an_off_by_one_refusal_is_caught_by_a_case_that_names_the_operation():
    def refuses_at_equal(pool, n):
        if n >= pool.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        return get_new_blocks(pool, n)

    report = checks.check_get_new_blocks(refuses_at_equal, seeds=2)
    line = report.results[2]
    assert not line.passed and line.name.startswith("exactly n free is enough")
    assert "4 free, get_new_blocks(4): got ValueError(" in line.detail
    assert "Diagnosis: off by one in the refusal" in line.detail
    assert [r.passed for r in report.results[:2]] == [True, True]


@pytest.mark.parametrize("words", [
    "Cannot get {n} free blocks from the pool",  # vLLM 0.33.0's
    "cannot get num_blocks={n} new blocks: only {free} are free",  # the library's
    "asked for {n} blocks, {free} free",
])
def test_any_value_error_that_names_the_count_passes(words):
    def fn(pool, n):
        free = pool.free_block_queue.num_free_blocks
        if n > free:
            raise ValueError(words.format(n=n, free=free))
        return get_new_blocks(pool, n)

    assert checks.check_get_new_blocks(fn, seeds=2)


@pytest.mark.parametrize("exc", [ValueError("pool exhausted"), RuntimeError("Cannot get 5 free blocks"),
                                 ValueError("only 4 free")])
def test_a_refusal_without_the_count_or_of_another_type_fails(exc):
    def fn(pool, n):
        if n > pool.free_block_queue.num_free_blocks:
            raise exc
        return get_new_blocks(pool, n)

    report = checks.check_get_new_blocks(fn, seeds=2)
    line = report.results[3]
    assert not line.passed and "expected a ValueError whose message names the 5 blocks" in line.detail
    assert "Diagnosis: the refusal does not name the count" in line.detail


def test_the_library_refuses_as_the_exercise_asks():
    from pagedkv.block_pool import BlockPool
    from pagedkv.checks.ch03_allocation import names_count

    pool = BlockPool(5)
    with pytest.raises(ValueError) as info:
        pool.get_new_blocks(5)
    assert names_count(info.value, 5)


# ------------------------------------ issue 45: gaps readers found
from pagedkv.block_pool import BlockPool  # noqa: E402
from pagedkv.free_queue import FreeKVCacheBlockQueue  # noqa: E402

WRITTEN = "the library's own function -- the task is to write it"


def _delegated(report, task, called, capsys):
    out = capsys.readouterr().out
    assert not report and not report.stub and len(report.results) == 1, out
    line = report.results[0]
    assert line.name == f"{task} is your own code"
    assert f"it calls the library's {called}. Diagnosis: {WRITTEN}" in line.detail
    assert "\u2705" not in out and out.rstrip().endswith(f"{task}: 0/1 properties hold")
    assert max(map(len, out.splitlines())) <= 79


def test_calling_the_librarys_get_new_blocks_is_refused(capsys):
    _delegated(checks.check_get_new_blocks(lambda pool, n: BlockPool.get_new_blocks(pool, n)),
               "get_new_blocks", "BlockPool.get_new_blocks", capsys)
    _delegated(checks.check_get_new_blocks(lambda pool, n: pool.get_new_blocks(n)),
               "get_new_blocks", "BlockPool.get_new_blocks", capsys)


def test_calling_the_librarys_free_blocks_or_touch_is_refused(capsys):
    def lib_free(pool, blocks):
        BlockPool.free_blocks(pool, blocks)

    _delegated(checks.check_free_blocks(lib_free, lambda p, b: lib_free(p, list(reversed(b)))),
               "free_blocks", "BlockPool.free_blocks", capsys)
    _delegated(checks.check_free_blocks(free_blocks, lambda p, b: p.free_blocks(list(reversed(b)))),
               "free_blocks", "BlockPool.free_blocks", capsys)
    _delegated(checks.check_touch(lambda pool, blocks: pool.touch(blocks)),
               "touch", "BlockPool.touch", capsys)


def test_subclassing_the_librarys_queue_is_refused(capsys):
    class Inherited(FreeKVCacheBlockQueue):
        pass

    class Super(FreeKVCacheBlockQueue):
        def popleft_n(self, n):
            return super().popleft_n(n)

    for cls in (Inherited, Super):
        report = checks.check_free_block_queue(cls)
        _delegated(report, "FreeKVCacheBlockQueue", "FreeKVCacheBlockQueue.popleft_n", capsys)


def test_an_empty_entry_left_behind_is_named_not_a_request_size():
    def leaves_empty(pool, n):
        queue = pool.free_block_queue
        if n > queue.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        blocks = queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                del pool.cached_block_hash_to_block[block.block_hash][block.block_id]
                block.reset_hash()
            block.ref_cnt = 1
        return blocks

    failed = {r.name: r.detail for r in checks.check_get_new_blocks(leaves_empty, seeds=2).results
              if not r.passed}
    assert failed
    for detail in failed.values():
        assert "Diagnosis: an empty entry left behind" in detail, failed
        assert "too many" not in detail


def _free_rule(rule):
    def fn(pool, ordered_blocks):
        head, tail = [], []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                hashed = block.block_hash is not None
                if rule == "all to the tail" or hashed != (rule == "swapped"):
                    tail.append(block)
                else:
                    head.append(block)
        pool.free_block_queue.prepend_n(head)
        pool.free_block_queue.append_n(tail)
    return fn


@pytest.mark.parametrize("rule, name", [
    ("all to the tail", "every block to the tail (vLLM's rule before 0.24)"),
    ("swapped", "head and tail swapped"),
])
def test_the_old_free_rule_and_swapped_ends_are_named(rule, name):
    fn = _free_rule(rule)
    report = checks.check_free_blocks(fn, lambda p, b: fn(p, reversed(b)), seeds=2)
    failed = [r for r in report.results if not r.passed]
    assert failed and f"Diagnosis: {name}" in failed[0].detail, failed
