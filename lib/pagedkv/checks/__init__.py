"""Exercise checkers: ``pagedkv.checks.check_<name>(your_function)``.

Each prints one line per property (a green tick or a red cross with a hint)
and returns a ``CheckReport`` that is truthy when every property holds. One
module per chapter; this package re-exports their ``check_*`` functions.
"""

from ._harness import CheckReport, Checker, PropertyResult  # noqa: F401
from .ch01_memory_budget import *  # noqa: F401,F403
from .ch01_shared_card import check_card_prediction, check_two_instances, plot_two_instances  # noqa: F401
from .ch02_fragmentation import *  # noqa: F401,F403
from .ch02_block_size import check_largest_block_size  # noqa: F401
from .ch02_hole_prediction import check_hole_prediction  # noqa: F401
from .ch03_block_pool import *  # noqa: F401,F403
from .ch04_block_table import *  # noqa: F401,F403
from .ch04_table_prediction import check_table_prediction  # noqa: F401
from .ch05_slot_mapping import *  # noqa: F401,F403
from .ch06_copy_on_write import *  # noqa: F401,F403
from .ch07_paged_attention import *  # noqa: F401,F403
from .ch03_pool_decisions import *  # noqa: F401,F403
from .ch03_allocation import *  # noqa: F401,F403
from .ch03_queue_prediction import check_free_queue_prediction  # noqa: F401
from .ch06_manager_decisions import *  # noqa: F401,F403
from .ch08_serving_engine import *  # noqa: F401,F403
from .ch07b_kernel_puzzles import (check_kernel_puzzle, print_puzzle_mistakes, show_reference,  # noqa: F401
                                   trace_kernel_puzzle)
from .ch07b_grid_prediction import SPLIT_TRACE, check_split_grid_prediction  # noqa: F401
from ._harness import print_mistakes  # noqa: F401
from .ch02_measure import check_worst_fit_experiment  # noqa: F401
from .ch03_measure import check_free_rule_experiment  # noqa: F401
from .ch04_measure import check_whole_row_experiment  # noqa: F401
from .ch05_measure import check_pow2_padding_experiment  # noqa: F401
from .ch06_measure import check_eager_fork_experiment  # noqa: F401
