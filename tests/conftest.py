import contextlib
import fcntl
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The whole suite and the fast subset run in two processes (pytest-xdist, `pytest_cmdline_main`
# below). A worker knows its id from PYTEST_XDIST_WORKER ("gw0", "gw1"), set before this file is
# imported; what the test session keeps (runtime folder, cache, the turn lock) lives under one
# folder that the controller makes and its workers inherit: one runtime folder and one cache each.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if not WORKER:
    os.environ["MEGATRAIN_NB_TEST_ROOT"] = tempfile.mkdtemp(prefix="mtnb-test-")
ROOT = os.environ.get("MEGATRAIN_NB_TEST_ROOT") or tempfile.mkdtemp(prefix="mtnb-test-")
# runs announce themselves (heartbeat files, trainer/control.py): into a folder of the test
# session's own (of the worker's own: the sidebar's tests list every heartbeat in it), never the
# user's Jupyter runtime folder
if WORKER or "MEGATRAIN_NB_RUNTIME_DIR" not in os.environ:
    os.environ["MEGATRAIN_NB_RUNTIME_DIR"] = tempfile.mkdtemp(prefix=f"runtime-{WORKER or 'main'}-", dir=ROOT)
# the engine's plans follow the planner's rules, never a measurement `megatrain-nb machine` cached
# on the machine running the tests (engine/planning/plan_pick.py); the tests of the predicted pick unset it.
# MEGATRAIN_NB_TEST_RATES=<a cache folder holding `megatrain-nb machine`'s measurement> (scripts/test.sh's
# second pass over the engine's memory and parity tests) is the other way round: the measured rates are
# in the cache and every engine plans by them, as a user's does after `megatrain-nb machine` -- the same
# tests must pass either way.
MEASURED_RATES = os.environ.get("MEGATRAIN_NB_TEST_RATES") or ""
if MEASURED_RATES:
    os.environ.pop("MEGATRAIN_NB_PLAN_BY", None)
else:
    os.environ["MEGATRAIN_NB_PLAN_BY"] = "rules"


def _test_cache() -> str:
    """A cache folder of the session's own (of each worker's own): no test reads (or leaves) this
    machine's measured rates (predictions, the dashboard's predicted step and the planner's pick see
    only the rates a test gives them; MEGATRAIN_NB_TEST_RATES copies a measurement in); the built-in corpus's cached tokenizers are linked in, not
    built again, and so are the fused update's compiled kernels (one build for the session and its
    workers: a worker links the controller's cache, whose entries are the user's or its own)."""
    user = os.environ.get("MEGATRAIN_NB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_nb")
    own = tempfile.mkdtemp(prefix=f"cache-{WORKER or 'main'}-", dir=ROOT)
    if os.path.isdir(user):
        for name in os.listdir(user):
            if not name.startswith("machine-"):
                os.symlink(os.path.join(user, name), os.path.join(own, name))
    if MEASURED_RATES:   # copied: the engine never follows a link to a cache file
        measured = [n for n in os.listdir(MEASURED_RATES) if n.startswith("machine-")]
        if not measured:
            raise RuntimeError(f"MEGATRAIN_NB_TEST_RATES={MEASURED_RATES}: no machine-*.json there "
                               f"(measure into it: MEGATRAIN_NB_CACHE={MEASURED_RATES} megatrain-nb machine)")
        for name in measured:
            shutil.copy(os.path.join(MEASURED_RATES, name), os.path.join(own, name))
    if not os.path.exists(os.path.join(own, "kernels")):
        os.mkdir(os.path.join(own, "kernels"), 0o700)
    return own


os.environ["MEGATRAIN_NB_CACHE"] = _test_cache()
# One intra-op thread: the test models are tiny (hidden 32-64), so a second torch thread buys
# nothing, while the engine's own threads (prefetch, AdamW worker, codecs, disk) want the other
# core, and on a busy 2-core machine torch's spinning OpenMP workers burned several times the CPU.
# Measured: the slow engine tests 15-20% shorter with one thread than with two.
torch.set_num_threads(1)
# And the same for every process a test starts (a notebook's kernel, a JupyterLab server's kernels,
# a CLI run, a worker script) that does not say otherwise: torch there took both cores, its OpenMP
# workers spinning beside the other worker's test. Set after torch's import, this process keeps
# the count set above. Measured (notebook 01 under nbclient, load 3.5-5, two pairs): the kernel's
# CPU 72 -> 57 s and 68 -> 62 s; notebook 02's the same either way (46-48 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A run of the whole suite or a subset of it by marker or keyword (`python -m pytest`,
    `python -m pytest -m "not slow"`: no path given) runs in MEGATRAIN_NB_TEST_WORKERS processes
    (default: 2, or the machine's cores if fewer) with pytest-xdist; a run naming files or tests runs
    in this one process, as does any run given `-n` itself (`-n 0`: one process), `--pdb`,
    `--collect-only` or `-p no:xdist`."""
    if WORKER:
        # xdist's worker parses the command line again, without the `--dist` set below, so it would
        # never add a test's group to its node id (`name@group`, what `loadgroup` schedules by): each
        # test of a module sharing a module's fixture went to either worker, and both made the fixture
        # (a torchrun job, a JupyterLab server, a trained model) -- told here by the controller
        if getattr(config, "workerinput", {}).get("megatrain_nb_dist") == "loadgroup":
            config.option.loadgroup = True
        return
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None:
        return
    if config.getoption("usepdb", False) or config.getoption("collectonly", False):
        return
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    workers = int(os.environ.get("MEGATRAIN_NB_TEST_WORKERS") or min(2, os.cpu_count() or 1))
    if workers > 1:
        config.option.numprocesses = workers
        if config.option.dist == "no":
            config.option.dist = "loadgroup"
            # the work goes out in the order `_longest_first` gives (xdist's own reorder would put
            # the groups of most tests first, whatever they take)
            config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)   # a hook of xdist's: unknown without it (-p no:xdist)
def pytest_configure_node(node):
    """(xdist's controller, for each worker it starts) The distribution mode, which the worker's own
    options do not carry (`pytest_cmdline_main`)."""
    node.workerinput["megatrain_nb_dist"] = node.config.option.dist


def pytest_addoption(parser):
    parser.addoption("--adversarial-transport", action="store_true",
                     help="run every engine on a CPU device through the adversarial transport (copies late at "
                          "random, buffers NaN-filled at their release, reuse before release raises)")


def pytest_configure(config):
    if config.getoption("--adversarial-transport", default=False):
        from megatrain_nb.engine.transport.transport import ADVERSARIAL_ENV

        os.environ[ADVERSARIAL_ENV] = "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# The fast subset is `python -m pytest -m "not slow"` (docs/DEVELOPMENT.md). Besides the tests
# marked `slow` in their own files, whole kinds of test are slow by nature and marked here, in
# one place: everything that starts ranks under torchrun or gloo (tests/distributed/) and every
# browser test.
SLOW_FOLDERS = ("distributed",)
# And the tests that took longest in the fast set (measured on 2 cores, `--durations`): many
# steps on the disk tier, end-to-end CLI runs, processes killed and restarted. What they check
# is also checked by a shorter test of the fast set; CI runs them all.
SLOW_TESTS = {
    "tests/engine/test_layer_major.py::" + name for name in (
        "test_20_steps_match_micro_batch_major", "test_default_clip_hold_goes_to_disk_when_the_host_budget_is_short",
        "test_disk_tier_bitwise_same_as_host_tier_counted_per_tier", "test_split_into_groups_loads_twice_per_group",
        "test_dropout_rng_restored_per_micro_batch_and_layer", "test_host_tier_same_result_counted_on_host",
        "test_clipping_holds_final_gradients_on_the_disk_tier", "test_counts_a4_each_layer_twice_and_no_host_gradients",
        "test_num_items_in_batch_and_loss_fn_and_tensor_micro_batches", "test_keep_all_activations_interval_0")
} | {
    "tests/engine/test_determinism.py::test_disk_tier_states_equal_ram_states",
    "tests/engine/test_determinism.py::test_large_unit_minimum_staging_equals_ram",
    "tests/engine/test_disk_cache.py::test_cached_disk_tier_moves_the_planned_bytes_and_trains_exactly",
    "tests/engine/test_disk_cache.py::test_back_to_back_overlapped_steps_read_the_updated_states",
    "tests/engine/test_disk_cache.py::test_cached_states_are_swapped_not_copied_and_train_exactly",
    "tests/engine/test_guards.py::test_a_layer_major_window_is_checked_too",
    "tests/engine/test_guards.py::test_skip_policy_drops_the_step_and_counts_it",
    "tests/engine/test_engine.py::test_20_adamw_steps_match_torch_adamw",
    "tests/engine/test_chunked_updates.py::test_chunked_updates_equal_the_whole_unit_bitwise",
    "tests/engine/test_chunked_updates.py::test_chunked_updates_on_the_disk_tier_equal_ram",
    "tests/engine/test_chunked_updates.py::test_codes_on_the_disk_tier_are_read_and_written_range_by_range_bitwise",
    "tests/engine/test_transport.py::test_layer_major_under_adversarial_transport",
    "tests/engine/test_reclaim.py::test_a_killed_process_folder_is_reclaimed_and_a_live_one_kept",
    "tests/engine/test_tiers.py::test_checkpoint_loads_into_weights_on_disk",
    "tests/test_cli.py::test_demo_quick_runs_the_main_job",
    # (measured 2026-12-06 at load 0.9, two workers: the fast subset at 2:54-3:04, over its budget by
    # these; test_train_from_a_config_file trains through the CLI in the fast set, the RAM tier's
    # rewind and fork are tests/notebook/test_branches.py's and the disk tier's without a cache
    # stays, and tests/test_layering.py imports the light entry points in a fresh interpreter)
    "tests/test_cli.py::test_a_preset_trains_on_a_text_jsonl_with_the_built_in_tokenizer",
    "tests/notebook/test_branches_disk.py::test_rewind_and_fork_on_the_disk_tier_are_exact[1]",
    "tests/test_planning_light.py::test_the_engine_package_loads_torch_only_for_the_engine",
    "tests/test_cli.py::test_demo_again_into_the_same_folder_is_a_new_run",
    "tests/test_cli.py::test_the_example_run_yaml_is_complete_and_runs",
    "tests/notebook/test_launch_spec.py::test_a_killed_kernels_launch_folder_is_reclaimed_at_the_next_start",
    "tests/notebook/test_launch_spec.py::test_a_kernel_that_exits_without_close_leaves_no_launch_folder",
    "tests/notebook/test_dashboard.py::test_a_rendering_widget_frontend_retires_the_html_fallback",
    "tests/notebook/test_dashboard.py::test_every_panel_shows_one_snapshot_after_each_refresh",
    "tests/notebook/test_report.py::test_report_in_a_browser_fires_no_dialog",
    "tests/trainer/test_checkpoint.py::test_resume_in_a_new_process_lands_on_the_uninterrupted_weights",
    "tests/trainer/test_checkpoint.py::test_killed_while_writing_leaves_the_previous_checkpoint_and_ignores_the_partial",
    "tests/trainer/test_save_protocol.py::test_kill_at_every_step_of_a_save_keeps_a_complete_checkpoint",
    # soaks and waits by the clock (hundreds of steps, reads made to take seconds, repeated
    # failures), and a fresh interpreter's imports
    "tests/notebook/test_dashboard.py::test_message_rate_is_bounded_during_hundreds_of_fast_steps",
    "tests/notebook/test_dashboard.py::test_html_fallback_is_rate_limited_and_ends_with_a_static_snapshot",
    "tests/engine/test_disk_store.py::test_a_read_that_takes_seconds_still_returns_the_right_data",
    "tests/trainer/test_release.py::test_five_failing_trainers_leave_the_thread_count_flat",
    "tests/trainer/test_sft.py::test_engine_does_not_import_trl",
    # fresh interpreters that import the whole stack (transformers, TRL, datasets), each several
    # seconds: the preset's first loss in two processes, the TRAINING.md SFT snippet trained until
    # it learns, SFT data preparation's stderr, the CLI without TRL, gpu_check's CPU rehearsal
    "tests/notebook/test_display_round_two.py::test_a_preset_session_gives_the_same_first_loss_in_two_fresh_processes",
    "tests/test_cli_display.py::test_the_readme_sft_snippet_visibly_learns",
    "tests/test_cli_display.py::test_preparing_sft_data_shows_no_map_bars_and_no_gradient_checkpointing_warning",
    "tests/test_cli_display.py::test_sft_without_trl_is_one_line_and_exit_2",
    "tests/engine/test_gpu_check_rehearsal.py::test_cpu_rehearsal_runs_every_section_and_prints_result_lines",
    "tests/engine/test_gpu_check_rehearsal.py::test_list_runs_from_a_bare_copy_of_the_checkout",
    "tests/engine/test_gpu_check_rehearsal.py::test_an_injected_section_failure_leaves_the_other_sections_lines",
    "tests/engine/test_gpu_accounting.py::test_the_loss_is_read_once_per_micro_batch_not_once_per_chunk",
    # over ~1.5 s each in the fast set with one thread (a 24-layer model; the disk tier's variant
    # of a case whose RAM variant stays; one door of four): a parametrized case by its own id
    "tests/engine/test_host_budget.py::test_host_peak_within_a_tight_budget_with_the_disk_tier",
    "tests/engine/test_host_in_flight.py::"
    "test_clipped_gradients_held_on_disk_leave_the_staging_buffers_and_come_back_in_chunks",
    "tests/trainer/test_recovery.py::test_a_run_that_diverges_twice_recovers_and_ends_reproducibly[disk]",
    "tests/trainer/test_save_protocol.py::test_exception_at_every_step_of_a_save_keeps_a_complete_checkpoint"
    "[existing-name]",
    "tests/trainer/test_snapshot.py::test_resuming_a_snapshot_lands_on_the_uninterrupted_weights[disk-int8]",
    "tests/trainer/test_snapshot.py::test_resuming_a_snapshot_lands_on_the_uninterrupted_weights[disk-none]",
    "tests/engine/test_transport.py::test_window_tiers_interval_2_under_adversarial_transport[disk]",
    "tests/lab/test_command_doors.py::test_every_command_through_every_door[inbox]",
    # issue 44: two Sessions built and closed (several seconds on a loaded machine)
    "tests/notebook/test_magics_status.py::test_status_names_the_open_sessions_when_the_current_one_was_closed",
    # issue 44: a disk-tier session trained twice over, rewound and resumed (items 1 and 3)
    "tests/notebook/test_snapshot_trust.py::test_a_rewind_to_a_rotted_snapshot_keeps_the_live_state_and_trains_on",
    "tests/notebook/test_snapshot_trust.py::test_a_disk_tier_file_of_another_step_is_refused_at_rewind_fork_and_resume",
    # issue 48: a trl.GRPOTrainer run and an mt.GRPOTrainer run each (generation, rewards, 4 steps)
    "tests/trainer/test_grpo_parity.py::test_same_completions_logs_and_weights_as_trl",
    "tests/trainer/test_grpo_parity.py::test_the_comparison_catches_another_seed",
    "tests/trainer/test_grpo_parity.py::test_evaluate_matches_trl_before_and_after_training",
    "tests/trainer/test_grpo.py::test_a_reward_model_scores_like_trl",
    "tests/trainer/test_grpo.py::test_a_model_folder_trains_as_the_module",
}

# The longest tests of the CI runs (their mean call time in seconds over the last seven runs'
# `--durations`, 2026-12-06/07, less what this session's changes took off; a name without a case
# id stands for every case of it): in a run of several workers they start first, longest first
# (`_longest_first` below), so that no long test starts last and leaves the other workers idle at
# the end. Only an order: a test missing here is merely started later. (A group's unit counts the
# sum of its tests: the engine-flow group of tests/distributed/, one shared launch and the loop's
# second, goes early by its many slow tests.)
LONGEST = {
    "tests/distributed/test_session_explore.py::test_snapshot_rewind_resume_and_fork_of_two_ranks_are_bit_exact": 96,
    "tests/notebook/test_notebooks.py::test_notebook_executes[01-quickstart]": 75,
    "tests/lab/test_sidebar_scale_browser.py::test_the_sidebar_orders_groups_and_nests_at_scale": 67,
    "tests/notebook/test_notebooks.py::test_notebook_executes[02-your-own-model]": 52,
    "tests/lab/test_e2e_browser.py::test_quickstart_notebook": 40,
    "tests/trainer/test_soak.py::test_short_soak_with_pauses_lr_changes_and_kill9_resumes": 37,
    "tests/notebook/test_kernel_launcher.py::test_launcher_in_a_real_kernel": 37,
    "tests/distributed/test_sft_torchrun.py::test_sft_two_ranks_equal_one_process[packed]": 20,
    "tests/distributed/test_sft_session.py::test_session_with_an_sft_config_trains_an_sft_trainer_on_two_ranks": 34,
    "tests/distributed/test_session_explore.py::test_a_fork_of_running_ranks_pauses_its_parent_when_it_starts": 33,
    "tests/trainer/test_grpo_ranks.py::test_two_ranks_equal_one_process[0.0-dapo]": 45,   # (both cases' runs)
    "tests/notebook/test_notebooks.py::test_notebook_executes[03-bigger-than-memory]": 31,
    "tests/engine/test_tiers.py::test_large_model_never_whole_in_ram[safetensors]": 30,
    "tests/distributed/test_dpo_torchrun.py::test_dpo_two_ranks_equal_one_process": 30,
    "tests/notebook/test_notebooks.py::test_notebook_executes[05-prefer-better-answers]": 29,
    "tests/notebook/test_run_tree_live_browser.py::test_the_branches_chart_follows_rewinds_and_forks": 29,
    "tests/distributed/test_trainer_torchrun.py::test_rank_death_then_rerun_with_resume_true": 28,
    "tests/engine/test_tiers.py::test_large_model_never_whole_in_ram[meta]": 28,
    "tests/trainer/test_grpo_ranks.py::test_a_two_rank_checkpoint_resumes_in_one_process": 15,
    "tests/notebook/test_untrusted_browser.py::test_an_untrusted_notebook_shows_the_snapshot_and_the_histogram_whole": 26,
    "tests/notebook/test_dashboard_browser.py::test_dashboard_layout_has_no_overlapping_or_clipped_text": 26,
    "tests/distributed/test_trainer_torchrun.py::test_rank_death_restarts_and_resumes_exactly": 26,
    "tests/distributed/test_dpo_session.py::test_session_with_a_dpo_config_trains_a_dpo_trainer_on_two_ranks": 25,
    "tests/notebook/test_notebooks.py::test_notebook_executes": 25,
    "tests/notebook/test_notebooks.py::test_notebook_executes[07-see-and-say]": 24,
    "tests/distributed/test_sft_torchrun.py::test_sft_two_ranks_equal_one_process[assistant]": 25,   # (both cases' launch)
    "tests/distributed/test_launcher.py::test_launcher_pause_lr_checkpoint_stop_land_on_every_rank_at_one_step": 24,
    "tests/notebook/test_kernel.py::test_session_in_a_real_kernel_with_magics": 23,
    "tests/distributed/test_trainer_torchrun.py::test_checkpoint_of_two_ranks_resumes_in_one_process": 22,
    "tests/distributed/test_engine_sharded.py::test_two_nodes_simulated_by_two_agents": 22,
    "tests/notebook/test_notebooks.py::test_notebook_executes[04-fine-tune-on-conversations]": 20,
    # (under 20 s: above a slow test's guess all the same)
    "tests/trainer/test_grpo_ranks_session.py::test_a_grpo_session_on_two_ranks_ends_where_one_process_ends": 19,
    "tests/notebook/test_run_tree_browser.py::test_the_dashboards_branches_panel_draws_the_tree_in_jupyterlab": 19,
    "tests/distributed/test_collective_order.py::test_every_rank_issues_the_collectives_in_one_order": 19,
    "tests/engine/test_gpu_check_rehearsal.py::test_cpu_rehearsal_runs_every_section_and_prints_result_lines": 18,
    "tests/distributed/test_rewind_ranks.py::test_snapshot_then_rewind_on_every_rank_is_bit_exact": 18,
    "tests/distributed/test_loopback.py::test_the_notebook_launcher_listens_on_loopback_only": 18,
    "tests/notebook/test_display_round_two.py::test_a_preset_session_gives_the_same_first_loss_in_two_fresh_processes": 18,
}
#: what a test not in LONGEST is taken to take: a slow one (a process, a notebook, a browser,
#: many steps), any other
SLOW_GUESS_S, FAST_GUESS_S = 8.0, 0.5

# Tests that time how soon something answers (a command applied within a second, `train()`
# returning within 0.3 s, a kernel's first answer within 2 s, a failed rank seen within a bound):
# in a run of two workers each runs with no test of the other worker beside it
# (`pytest_runtest_protocol` below), so that they measure the code and not the neighbour. A module
# (or a test) by its node id.
ALONE_TESTS = {
    "tests/notebook/test_session.py::test_train_returns_at_once_and_runs_in_background",
    "tests/notebook/test_session.py::test_stop_ends_within_one_step_and_releases_everything",
    "tests/lab/test_handlers.py::test_command_reaches_the_session_within_a_second",
    "tests/lab/test_beacon.py::test_command_takes_effect_within_one_second",
    "tests/notebook/test_kernel_launcher.py",
    # (train() returning within 3 s in a real kernel, alone until then: `timed_part_done`)
    "tests/notebook/test_kernel.py::test_session_in_a_real_kernel_with_magics",
    # (of tests/distributed/test_launcher.py, the two that time an answer: `train()` returning within
    # 3 s -- alone until then, `timed_part_done` --, the killed rank seen within SEEN_LATE_S of the
    # error it caused; its others wait on bounds of a minute and run beside other tests)
    "tests/distributed/test_launcher.py::test_launcher_pause_lr_checkpoint_stop_land_on_every_rank_at_one_step",
    "tests/distributed/test_launcher.py::test_a_rank_killed_with_signal_9_is_named_first_not_the_rank_its_death_broke",
    "tests/engine/test_disk_store.py::test_a_read_that_takes_seconds_still_returns_the_right_data",
    "tests/engine/test_disk_store.py::test_eio_on_a_read_is_a_clear_error_in_bounded_time",
}


def _alone(item) -> bool:
    name = item.nodeid.split("[", 1)[0].split("@", 1)[0]
    return name in ALONE_TESTS or name.split("::", 1)[0] in ALONE_TESTS


@contextlib.contextmanager
def _turn(alone: bool):
    """A test's turn in a run of several workers: shared by ordinary tests, the whole machine's for
    one that must run alone (a readers-writer lock on a file in the session's folder; holding the
    gate while it waits, an alone test goes before ordinary tests that come after it)."""
    gate = os.open(os.path.join(ROOT, "turn.gate"), os.O_CREAT | os.O_RDWR, 0o600)
    turn = os.open(os.path.join(ROOT, "turn.lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(turn, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield turn
    finally:
        for fd in (turn, gate):   # let go explicitly: a child forked meanwhile shares the open files
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In a worker, a test (its fixtures' setup and teardown included) runs in its turn."""
    if not WORKER:
        return (yield)
    with _turn(_alone(item)) as turn:
        _TURNS[item.nodeid] = turn
        try:
            return (yield)
        finally:
            del _TURNS[item.nodeid]


_TURNS: dict = {}   # a running test's node id -> its turn's lock


@pytest.fixture
def timed_part_done(request):
    """For a test of ALONE_TESTS whose timed checks come first: calling it shares the machine again
    (its lock held shared from then on), so that the other worker's tests run beside the rest of it
    (a no-op in one process)."""
    def share() -> None:
        turn = _TURNS.get(request.node.nodeid)
        if turn is not None:
            fcntl.flock(turn, fcntl.LOCK_SH)
    return share


def _mark_slow_kinds(items, args=()):
    modules = {}
    for item in items:
        name = item.nodeid.split("[", 1)[0]
        if getattr(item, "module", None) is not None:
            modules[name.split("::", 1)[0]] = item.module
        folder = item.path.parent.name
        if (folder in SLOW_FOLDERS or item.get_closest_marker("browser") or name in SLOW_TESTS
                or item.nodeid in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    # a renamed or removed test would silently stop being marked: refuse its stale entry
    named = SLOW_TESTS | {n for n in ALONE_TESTS if "::" in n}
    stale = sorted(n for n in named if n.split("::", 1)[0] in modules
                   and not hasattr(modules[n.split("::", 1)[0]], n.split("::", 1)[1].split("[", 1)[0]))
    # a case named by its id: refused when its test's cases were all collected, without that id
    # (not when the command line picked single tests or cases out of its file)
    picked = {a.split("::", 1)[0] for a in args if "::" in a}
    ids, cased = {item.nodeid for item in items}, {item.nodeid.split("[", 1)[0] for item in items}
    stale += sorted(n for n in SLOW_TESTS if "[" in n and n.split("[", 1)[0] in cased and n not in ids
                    and not any(n.startswith(p) or p.endswith(n.split("::", 1)[0]) for p in picked))
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS or ALONE_TESTS names tests that do not exist: {stale}")


def _group_shared_fixtures(items):
    """A module whose tests share a fixture of module scope (a torchrun job, a JupyterLab server, a
    trained model) runs on one worker, so that the fixture is made once (xdist's `loadgroup`). A
    test marked with a group of its own (a launch that tests of several modules read, made once a
    worker: tests/distributed/launch.py's `engine_flow_runs`) keeps that one group alone."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d.scope in ("module", "class", "package", "session") and d.baseid
               for ds in defs.values() for d in ds):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def _name_groups(items) -> None:
    """(A worker under `loadgroup`, after xdist's own hook) A grouped test's node id as `name@group`,
    which is what xdist's controller schedules by. xdist (3.8) writes it into `item._nodeid`, which
    pytest 9.2's items no longer read (their id is `item._id`, a NodeId): without this, every test
    of a grouped module went to either worker and both made the module's fixture."""
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if not groups or "@" in item.nodeid:
            continue
        named = f"{item.nodeid}@{'_'.join(groups)}"
        ident = getattr(item, "_id", None)
        if ident is not None and not isinstance(ident, str):
            item._id = type(ident).parse(named)
        else:
            item._nodeid = named


def _guess_s(item) -> float:
    name = item.nodeid.split("@", 1)[0]
    known = LONGEST.get(name, LONGEST.get(name.split("[", 1)[0]))
    if known is not None:
        return known
    return SLOW_GUESS_S if item.get_closest_marker("slow") else FAST_GUESS_S


def _longest_first(items) -> None:
    """(A worker's collection, which xdist hands out in its order.) Each unit of work (a test, or
    the tests of a group, kept together and in their order) in this order: the tests that must run
    alone first (run at the start, one after another, they never wait for a long test of another
    worker to end, nor keep another worker waiting mid-run), then the longest first (by LONGEST,
    else a guess by the slow mark), the collection's order among equals."""
    units: dict = {}
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        units.setdefault("_".join(groups) or item.nodeid, []).append(item)
    ordered = sorted(enumerate(units.values()), key=lambda u: (
        not any(_alone(i) for i in u[1]), -sum(_guess_s(i) for i in u[1]), u[0]))
    items[:] = [item for _, unit in ordered for item in unit]


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Marks the slow kinds and groups the tests that share a module's fixture; without chromium
    (or playwright) the browser tests are left out, with one line saying why."""
    _mark_slow_kinds(items, config.args)
    _group_shared_fixtures(items)
    if WORKER:
        _longest_first(items)
    from tests.browser import missing

    browser = [item for item in items if item.get_closest_marker("browser")]
    why = missing() if browser else None
    if why:
        items[:] = [item for item in items if not item.get_closest_marker("browser")]
        config.hook.pytest_deselected(items=browser)
        config._megatrain_browser_note = f"browser tests skipped ({len(browser)}): {why}"
        if hasattr(config, "workeroutput"):   # an xdist worker: the note goes to the controller's summary
            config.workeroutput["megatrain_browser_note"] = config._megatrain_browser_note


@pytest.hookimpl(tryfirst=True)   # before xdist's worker sends its collection's node ids
def pytest_collection_finish(session):
    if WORKER and session.config.getvalue("loadgroup"):
        _name_groups(session.items)


@pytest.hookimpl(optionalhook=True)   # a hook of xdist's: unknown without it (-p no:xdist)
def pytest_testnodedown(node, error):
    """(xdist's controller) A worker's note, said once in the summary."""
    note = getattr(node, "workeroutput", {}).get("megatrain_browser_note")
    if note:
        node.config._megatrain_browser_note = note


def pytest_terminal_summary(terminalreporter, config):
    note = getattr(config, "_megatrain_browser_note", None)
    if note:
        terminalreporter.write_line(note, yellow=True)
