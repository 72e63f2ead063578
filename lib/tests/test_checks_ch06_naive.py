"""Exercise 6 without skeletons: a newcomer's plausible first attempts fail, each with a named red line."""

from pagedkv import checks


def cow_keeping_the_old_owner(pool, request_id):
    table = pool.tables[request_id]
    old = table[-1]
    new = pool.allocate_page()
    pool.pages[new] = list(pool.pages[old])
    table[-1] = new
    pool.owners[new].add(request_id)
    return new


def lookup_without_the_cap(manager, request):
    blocks = []
    for h in request.block_hashes:
        block = manager.block_pool.get_cached_block(h)
        if block is None:
            break
        blocks.append(block)
    return blocks, len(blocks) * manager.block_size


def watermark_for_everyone(manager, request, num_blocks, num_evictable_hits, has_scheduled_reqs):
    return num_blocks + num_evictable_hits <= manager.get_num_free_blocks() - manager.watermark_blocks


def test_a_copy_that_keeps_the_old_owner_is_named(capsys):
    report = checks.check_copy_on_write(cow_keeping_the_old_owner)
    assert not report.passed
    assert "Diagnosis: the old owner reference kept" in report.results[0].detail


def test_a_lookup_without_the_cap_is_named(capsys):
    report = checks.check_get_computed_blocks(lookup_without_the_cap)
    assert not report.passed
    assert "Diagnosis: no -1 cap" in report.results[0].detail


def test_a_watermark_held_back_always_is_named(capsys):
    report = checks.check_can_allocate(watermark_for_everyone)
    assert not report.passed
    assert "Diagnosis: watermark held back always" in report.results[0].detail
