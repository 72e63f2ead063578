"""Exercise 6's experiment (copy at the fork): the policy, the peak pages for it, the prediction."""

from pagedkv.checks.ch06_measure import check_eager_fork_experiment as check, peak_pages
from pagedkv.sim import FORK_WORKLOAD, run_forks
from pagedkv.sim.paged_kv import PagedKV


class Eager(PagedKV):
    def fork(self, parent_id, child_id):
        parent = self.tables[parent_id]
        if child_id in self.tables:
            raise ValueError(child_id)
        if len(self.free) < len(parent):
            raise MemoryError("no room")
        copies = []
        for page in parent:
            copy = self.allocate_page()
            self.pages[copy].extend(self.pages[page])
            self.owners[copy].add(child_id)
            copies.append(copy)
        self.tables[child_id] = copies


class NoOwners(PagedKV):
    def fork(self, parent_id, child_id):
        if len(self.free) < len(self.tables[parent_id]):
            raise MemoryError("no room")
        copies = []
        for page in self.tables[parent_id]:
            copy = self.allocate_page()
            self.pages[copy].extend(self.pages[page])
            copies.append(copy)
        self.tables[child_id] = copies


class TailOnly(PagedKV):
    """Shares the full pages and copies only the tail: copy-on-write done early."""

    def fork(self, parent_id, child_id):
        parent = self.tables[parent_id]
        if child_id in self.tables:
            raise ValueError(child_id)
        if not self.free:
            raise MemoryError("no room")
        table = list(parent)
        copy = self.allocate_page()
        self.pages[copy].extend(self.pages[parent[-1]])
        table[-1] = copy
        self.tables[child_id] = table
        for page in table:
            self.owners[page].add(child_id)


class Partial(Eager):
    """Allocates as it goes and runs out half way: a refusal that leaves copies behind."""

    def fork(self, parent_id, child_id):
        copies = []
        for page in self.tables[parent_id]:
            copy = self.allocate_page()  # MemoryError mid-way
            self.pages[copy].extend(self.pages[page])
            self.owners[copy].add(child_id)
            copies.append(copy)
        self.tables[child_id] = copies


TRUE = peak_pages(Eager)
SHARED = run_forks(PagedKV).peak_pages


def test_the_eager_peak_is_every_sample_owning_its_table():
    w = FORK_WORKLOAD
    assert TRUE == w.samples * sum(-(-(n + w.output_len) // w.block_size) for n in w.prompt_lengths())
    assert TRUE > 2 * SHARED


def test_right_policy_measurement_and_prediction_pass():
    report = check(Eager, TRUE - 20, TRUE, verbose=False)
    assert report.passed, [r.detail for r in report.results]


def test_wrong_policies_are_named():
    assert "Diagnosis: owners not kept" in check(NoOwners, None, None, verbose=False).results[0].detail
    assert "Diagnosis: only the partial tail copied" in check(TailOnly, None, None,
                                                              verbose=False).results[0].detail
    assert "Diagnosis: a partial fork left behind" in check(Partial, None, None,
                                                            verbose=False).results[0].detail


def test_calling_the_library_fork_is_refused_by_name():
    class Shares(PagedKV):
        def fork(self, parent_id, child_id):
            super().fork(parent_id, child_id)

    report = check(Shares, 500, SHARED, verbose=False)
    assert "calls the library's PagedKV.fork" in report.results[0].detail


def test_wrong_measurements_are_named():
    assert "Diagnosis: the library's fork measured" in check(Eager, 500, SHARED,
                                                             verbose=False).results[1].detail
    w = FORK_WORKLOAD
    prompts = w.samples * sum(-(-n // w.block_size) for n in w.prompt_lengths())
    assert "Diagnosis: the prompts alone" in check(Eager, 500, prompts,
                                                   verbose=False).results[1].detail


def test_far_predictions_say_what_they_missed():
    low = check(Eager, SHARED, TRUE, verbose=False).results[2]
    high = check(Eager, 2 * TRUE, TRUE, verbose=False).results[2]
    assert not low.passed and "paid once per sample" in low.detail
    assert not high.passed and "no copies on top" in high.detail


def test_a_crash_and_a_non_class_are_named():
    class Crash(PagedKV):
        def fork(self, parent_id, child_id):
            return self.tables[child_id]

    report = check(Crash, 500, TRUE, verbose=False)
    assert "KeyError" in report.results[0].detail
    assert "Diagnosis: a crash in your policy" in report.results[0].detail
    assert "not a PagedKV subclass" in check(None, verbose=False).results[0].detail
