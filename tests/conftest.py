"""Session-wide test settings shared by every test folder."""

import os
import sys
from typing import Iterator

import pytest

# Prefect's ephemeral server starts slowly on small machines; never phone home from tests.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The suite starts some eighty Python processes that import memplan (CLI runs, examples, ranks, flow runs, Dask
# workers) and three xdist workers that rewrite every test module's asserts: with PYTHONDONTWRITEBYTECODE set,
# as on many CI hosts, each compiled it all again (4 CPU-s of collection per worker, 0.5 s per process).
# Bytecode goes to the __pycache__ folders .gitignore lists.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Models are built from configs with random weights: never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Each xdist worker gets its share of the cores for torch's OpenMP pool (and the processes it starts):
# two workers with a pool of every core each oversubscribe the machine, and spinning OpenMP threads then
# slow a step several-fold (measured: test_variant_rules.py 50 s with 1 thread, 100 s with 2, beside a busy
# worker).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    import torch

    torch.set_num_threads(_share)


@pytest.fixture(scope="session")
def harness() -> Iterator[str]:
    """One Prefect test harness (a server of its own) for the test session of a worker; yields its API URL, for
    the `memplan` processes a test starts."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


SHARED_CAPTURES = ("tests/runtime/test_executor.py", "tests/runtime/test_acg_plans.py")
"""Modules that trace the same torchvision models: one xdist worker runs them together, first, so each model
is traced once per suite instead of once per worker."""


def _work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "shared-captures" if module in SHARED_CAPTURES else module


WAITING = ("tests/fleet/test_fleet_ops.py", "tests/fleet/test_scheduler.py", "tests/fleet/test_scheduled_zombies.py")
"""Modules that mostly wait on Prefect's clocks (a dead host's run is marked crashed after `zombie_after_s`
without a heartbeat; a cron run starts on the minute): about 80 of their 140 s. With 3 or more xdist workers
the last one runs only these, beside the others' CPU-bound tests, so the waits overlap with work."""


def pytest_xdist_make_scheduler(config, log):
    """Scheduling for the xdist workers of pyproject's addopts: a module's tests stay on one worker (as with
    `--dist loadfile`: module fixtures such as captures are built once), SHARED_CAPTURES together; with 3 or
    more workers, the last is a lane for the WAITING modules, which the others take only once they have
    nothing else."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def _waiting_lane(self, node) -> bool:
            return len(self.nodes) >= 3 and node is self.nodes[-1]

        def _next_unit(self, node) -> str | None:
            """The first queued unit of the node's lane; for a worker of the others, any unit once its own
            lane's are gone."""
            lane = self._waiting_lane(node)
            mine = next((scope for scope in self.workqueue if (scope in WAITING) == lane), None)
            return mine if mine is not None or lane else next(iter(self.workqueue), None)

        def _assign_work_unit(self, node) -> None:
            scope = self._next_unit(node)
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def schedule(self) -> None:
            super().schedule()
            for node in self.nodes:                 # a lane with nothing queued is never given a test
                if not node.shutting_down and not self.assigned_work.get(node):
                    self._reschedule(node)

        def _reschedule(self, node) -> None:
            if not node.shutting_down and self._next_unit(node) is None \
                    and not self._pending_of(self.assigned_work.get(node, {})):
                node.shutdown()                 # its lane is done (the base class waits for an empty queue)
                return
            super()._reschedule(node)

    return ModuleScheduling(config, log)


LONGEST_FIRST = ("tests/pipeline/test_training_doc.py", "tests/pipeline/test_zoo.py", "tests/fleet/test_dask_runner.py",
                 "shared-captures",
                 "tests/pipeline/test_default_pipeline.py", "tests/pipeline/test_fit.py", "tests/fleet/test_fleet_e2e.py",
                 "tests/runtime/test_compiled_search.py")
"""The work units of 30 s and more (each 30-100 s on 2 cores), longest first."""


SLOW: dict[str, str | tuple[str, ...]] = {
    # tests/adversarial
    "tests/adversarial/test_caches_and_publish.py": (
        "`memplan run` twice (Prefect), or a model traced per cache key",
        "test_editing_a_factory_s_source_changes_every_cache_key",
        "test_a_deleted_solutions_folder_is_rebuilt_by_the_next_run",
    ),
    "tests/adversarial/test_clear_errors.py": (
        "`memplan` processes that trace a model or reach for a Prefect API",
        "test_an_error_inside_a_stage_prints_memplan_s_message_once",
        "test_an_unreachable_prefect_api_is_named_before_any_stage",
        "test_bad_models_and_locations_fail_before_any_stage_in_a_few_lines[shape]",
        "test_bad_models_and_locations_fail_before_any_stage_in_a_few_lines[labels]",
        "test_bad_models_and_locations_fail_before_any_stage_in_a_few_lines[batch]",
    ),
    "tests/adversarial/test_fuzz.py": (
        "hypothesis runs mutated plans",
        "test_mutated_plans_raise_plan_errors",
    ),
    "tests/adversarial/test_interrupt.py": (
        "starts long `memplan` commands and interrupts each",
        "test_ctrl_c_stops_the_run_within_seconds_with_one_line_and_no_process_left",
        "test_sighup_ends_a_run_and_its_prefect_server",
        "test_every_long_command_stops_within_seconds",
        "test_a_signal_during_validation_stops_the_run_within_two_seconds",
    ),
    "tests/adversarial/test_readonly_sql.py": (
        "`memplan query` processes over a profiled store",
        "test_no_statement_writes_any_file",
        "test_documented_views_and_readme_queries_still_answer",
    ),
    "tests/adversarial/test_store_resolution.py": (
        "`memplan` processes in several folders",
        "test_commands_read_the_store_of_the_pipeline_file_here_or_given",
    ),
    # tests/fleet
    "tests/fleet/test_fleet_e2e.py": "PostgreSQL, a Prefect server and two workers profiling on a cron schedule",
    "tests/fleet/test_fleet_ops.py": "a Prefect server on PostgreSQL and workers; waits out a dead host's heartbeat",
    "tests/fleet/test_dask_runner.py": "the default pipeline's plans on a local and an external Dask cluster",
    "tests/fleet/test_scheduler.py":
        "Prefect's scheduler service (a process on SQLite; a server and a worker waiting for a cron minute)",
    "tests/fleet/test_killed_profile.py": "a profiling process killed mid-profile, then a rerun",
    "tests/fleet/test_dask_dashboard.py": (
        "a local Dask cluster with its bokeh dashboard",
        "test_the_local_clusters_dashboard_answers_where_asked",
    ),
    "tests/fleet/test_store_access.py": (
        "`memplan profile` against the S3 test server",
        "test_a_missing_bucket_fails_before_any_stage_naming_the_bucket[profile]",
    ),
    "tests/fleet/test_store_url.py": (
        "writer processes on the S3 test server",
        "test_two_processes_write_at_once_and_every_run_arrives_whole",
        "test_a_writer_killed_mid_write_leaves_no_visible_file",
    ),
    # tests/pipeline
    "tests/pipeline/test_readme.py": "traces resnet18, solves and trains three steps with the plan",
    "tests/pipeline/test_gqa_pipeline.py": "`memplan run` on a grouped-query attention decoder",
    "tests/pipeline/test_example_solver.py": "a new solver through `memplan run`, `memplan solve` and `runtime.load`",
    "tests/pipeline/test_flows.py": "every test reads the module's `memplan run` (Prefect) or runs one",
    "tests/pipeline/test_compiled_pipeline.py": (
        "`memplan run` in the compiled form: inductor compiles each plan it measures",
        "test_each_budget_gets_a_validated_compiled_plan_within_it_or_says_what_was_measured",
        "test_the_published_compiled_plan_trains_like_eager_pytorch_in_a_plain_loop",
    ),
    "tests/pipeline/test_overhead_walk.py": "`memplan run` with overhead limits, measured and walked",
    "tests/pipeline/test_policy_optimizer_pipeline.py":
        "every test reads the module's `memplan run` (policy form, AdamW)",
    "tests/pipeline/test_training_doc.py": (
        "the doc's examples: captures, gloo ranks, torch.compile, transformers.Trainer",
        "test_pipeline_publishes_a_policy_plan_the_example_trains_with",
        "test_pipeline_publishes_a_compiled_plan_the_example_trains_with",
        "test_plain_loop_and_torch_compile",
        "test_distributed_examples_print_one_mean_loss",
        "test_mixed_precision",
        "test_hugging_face_trainer",
        "test_optimizer_in_step",
        "test_optimizer_in_step_in_the_policy_form",
        "test_executor_under_ddp",
        "test_the_compiled_form",
    ),
    "tests/pipeline/test_default_pipeline.py": (
        "`memplan run` on the default pipeline.toml: 13 plans solved, validated, timed",
        "test_the_default_pipeline_runs_end_to_end",
        "test_every_default_plan_exists_on_a_device_with_twice_the_scratch",
    ),
    "tests/pipeline/test_fit.py": (
        "the whole `memplan fit`: a Prefect flow searching, solving and validating batch sizes",
        "test_a_limit_too_small_for_batch_1_is_explained",
        "test_memplan_fits_a_larger_batch_than_eager_and_its_plan_runs_under_the_limit",
        "test_the_sequence_search_varies_the_token_inputs_length_at_the_batch",
    ),
    "tests/pipeline/test_cell_isolation.py": (
        "the module's `memplan run` with failing cells (Prefect), or a policy plan of GPT-2 captured and trained",
        "test_a_cell_whose_solver_raises_fails_alone_in_one_paragraph",
        "test_a_validation_raising_for_one_plan_leaves_the_other_plan_of_the_model_validated_and_published",
        "test_a_model_that_cannot_be_built_fails_its_own_cells_only",
        "test_memplan_run_shows_each_failed_cell_and_exits_1",
        "test_the_runs_table_says_why_a_cell_failed",
        "test_a_policy_plan_recomputing_attention_trains_like_eager",
        "test_capture_traces_the_step_without_a_cache",
    ),
    "tests/pipeline/test_cli.py": (
        "`memplan` processes (help, plans list)",
        "test_help_lists_the_commands_without_importing_torch",
        "test_help_texts_print_bracketed_words_as_typed",
        "test_plans_list_takes_the_plans_folder_a_config_and_a_format",
    ),
    "tests/pipeline/test_cli_run.py": (
        "`memplan run` through Prefect",
        "test_run_prints_the_table_and_publishes_the_plan",
        "test_refresh_re_runs_the_cached_stages",
        "test_a_plan_failing_validation_exits_1_and_publishes_nothing",
        "test_a_budget_this_device_cannot_meet_is_reported_and_does_not_fail_the_run",
    ),
    "tests/pipeline/test_cli_validate_publish.py": (
        "`memplan validate` and `publish` measure plans",
        "test_validate_passes_a_published_plan",
        "test_validate_and_publish_refuse_a_plan_over_its_budget",
        "test_publish_validates_then_publishes_once",
        "test_validate_and_publish_measure_a_max_overhead_plan_against_its_no_recompute_plan",
    ),
    "tests/pipeline/test_device_memory.py": (
        "a pipeline run, or validation, under a device memory limit",
        "test_a_step_eager_cannot_fit_is_planned_validated_against_checkpointing_and_published",
        "test_a_plan_past_the_limit_fails_validation_against_a_reference_that_fits",
    ),
    "tests/pipeline/test_host_reference.py": (
        "a pipeline run validated against a host reference",
        "test_a_batchnorm_step_no_device_reference_fits_is_validated_on_the_host_and_published",
    ),
    "tests/pipeline/test_mixed_precision.py": (
        "low-precision plans solved and validated",
        "test_low_precision_plan_validates_at_its_predicted_peak",
        "test_policy_form_under_float16_autocast_with_a_grad_scaler_trains_like_eager",
    ),
    "tests/pipeline/test_models.py": (
        "traces torchvision and transformers models",
        "test_torchvision_model_takes_kwargs_and_seed",
        "test_causal_lm_of_a_transformers_lm_is_its_labels_loss_and_capture_fuses_it_with_the_head",
        "test_an_encoder_decoder_and_an_encoder_train_with_the_labels_loss",
    ),
    "tests/pipeline/test_zoo.py": "one model per family traced, profiled, planned, validated and trained (~210 s)",
    "tests/pipeline/test_policy_pipeline.py": (
        "the module's `memplan run` (policy form), or solves and validates policies",
        "test_the_policy_plan_is_solved_on_the_eager_graph_and_published",
        "test_a_compiled_cell_is_published_by_its_measured_search",
        "test_an_infeasible_policy_cell_cites_the_least_budget_its_own_solver_reaches",
        "test_the_profile_flow_profiles_the_eager_graph_too",
        "test_the_published_policy_plan_trains_like_eager_pytorch_in_a_plain_loop",
        "test_the_report_says_how_to_run_each_form",
        "test_a_policy_plan_is_validated_the_way_it_runs",
        "test_a_compiled_policy_plan_is_validated_under_torch_compile_too",
        "test_the_solve_stage_marks_a_plan_solved_compiled",
        "test_a_compiled_cell_is_planned_by_its_measured_compiled_peak",
    ),
    "tests/pipeline/test_reference.py": (
        "validates plans against reference steps",
        "test_a_plan_checked_against_the_reference_keeps_its_verdicts",
        "test_plans_validated_together_get_the_verdicts_they_get_alone",
        "test_a_cell_mixing_the_optimizer_inside_and_outside_the_step_is_validated_against_one_reference",
        "test_one_reference_serves_every_plan_of_a_cell_and_sizes_eager_budgets",
    ),
    "tests/pipeline/test_validate.py": (
        "solves and validates plans (arena mode, dropout, optimizer in the step)",
        "test_a_plan_with_addresses_is_validated_in_arena_mode_too",
        "test_a_plan_recomputing_dropout_is_validated_bit_for_bit",
        "test_a_plan_with_the_optimizer_inside_the_step_is_solved_and_validated_on_parameters",
    ),
    "tests/pipeline/test_validate_gate.py": (
        "validates a plan over its budget",
        "test_a_plan_over_its_budget_fails_with_the_tolerances_in_their_places",
    ),
    # tests/profile
    "tests/profile/test_concurrent_writers.py": "eight profiling processes writing at once",
    "tests/profile/test_profile.py": (
        "profiles graphs, some repeatedly",
        "test_every_node_gets_one_row_with_the_graph_output_bytes",
        "test_a_large_matmul_measures_far_more_than_a_small_relu",
        "test_repeated_profiles_agree_within_tolerance",
        "test_profile_graph_writes_a_run_that_planners_read",
        "test_threads_setting_is_applied_recorded_and_restored",
        "test_a_bound_on_kept_values_profiles_the_same_memory_in_less",
    ),
    "tests/profile/test_profile_variants.py": (
        "profiles every variant rule",
        "test_every_rule_gets_rows_and_the_compact_backward_reads_less",
    ),
    "tests/profile/test_variant_verification.py": (
        "profiles a Llama decoder (the module's `llama`) and its variants",
        "test_a_grouped_query_decoder_profiles_and_trains_like_eager_with_math_attention",
        "test_a_variant_that_fails_is_dropped_on_its_node_and_the_run_goes_on",
        "test_the_default_implementation_failing_still_stops_the_profile",
        "test_a_bit_identical_plan_skips_a_variant_not_exact_on_this_device",
    ),
    # tests/runtime
    "tests/runtime/test_compiled_search.py": "every test measures GPT-2 plans, some under torch.compile",
    "tests/runtime/test_executor_ddp.py": "two gloo ranks",
    "tests/runtime/test_policy_ddp.py": "two gloo ranks",
    "tests/runtime/test_policy_fsdp.py": "two gloo ranks under FSDP2",
    "tests/runtime/test_policy_trainer.py": "transformers.Trainer with and without the plan",
    "tests/runtime/test_hierarchical_plans.py": "a hierarchical GPT-2 plan, solved and trained",
    "tests/runtime/test_monet_plans.py": "MONeT plans solved and trained",
    "tests/runtime/test_compiled_plans.py": (
        "inductor compiles",
        "test_runtime_load_runs_a_compiled_plan_as_decided_with_eager_gradients",
        "test_a_step_that_graph_breaks_is_refused_naming_where",
    ),
    "tests/runtime/test_compiled_form.py": (
        "torch.compile (the module's `runs`, inductor's C++ backend)",
        "test_the_compiled_step_recomputes_what_the_solver_decided_and_saves_none_of_it",
        "test_the_compiled_form_trains_like_eager",
        "test_a_lower_fraction_saves_and_measures_less",
        "test_a_decision_that_names_no_forward_node_is_refused",
    ),
    "tests/runtime/test_acg_plans.py": "ACG plans of two CNNs, solved exactly and trained",
    "tests/runtime/test_arena.py": (
        "traces and trains resnet18 and GPT-2 in arena mode (mlp's case stays)",
        "test_arena_plan_trains_like_eager_at_the_simulated_arena_peak",
        "test_addresses_for_in_place_nodes_only_leave_nothing_outside_the_arena",
    ),
    "tests/runtime/test_capture.py": (
        "traces GPT-2 and larger models, or in another process",
        "test_node_function_runs_each_node_alone[gpt2]",
        "test_recomputed_dropout_output_reuses_its_mask_without_drawing",
        "test_tied_weights_get_one_gradient_output_per_name",
        "test_capture_is_deterministic_and_leaves_the_model_alone",
        "test_capture_allocates_nothing_so_a_step_larger_than_the_device_is_captured",
        "test_fingerprint_changes_with_shape_dtype_and_mode[batch size]",
        "test_fingerprint_changes_with_shape_dtype_and_mode[dtype]",
        "test_attention_without_dropout_draws_nothing",
        "test_fingerprint_is_the_same_in_another_process",
        "test_concatenations_of_growing_lists_are_chained",
        "test_pointwise_input_gradients_are_matrix_products_where_aten_uses_its_gemm_path",
        "test_a_transformers_lm_run_without_cache_captures_with_or_without_a_mask",
    ),
    "tests/runtime/test_capture_encoders.py": (
        "traces and trains BERT, RoBERTa, T5 and BART",
        "test_bert_masked_lm_with_an_all_ones_attention_mask_trains_like_eager_and_on_a_padded_batch",
        "test_bert_masked_lm_without_a_mask_gives_a_tied_alias_no_gradient_output",
        "test_an_unused_pooler_keeps_no_gradient_as_in_eager",
        "test_roberta_masked_lm",
        "test_t5_with_labels",
        "test_bart_with_labels",
    ),
    "tests/runtime/test_capture_modules.py": (
        "traces models by layer",
        "test_boundaries_tag_each_layers_forward_nodes_and_leave_the_graph_unchanged",
        "test_batchnorm_running_statistics_do_not_cut_a_checkpointed_block",
        "test_each_layers_children_are_recorded_as_its_parts_unless_called_twice",
    ),
    "tests/runtime/test_ddp_buckets.py": (
        "two gloo ranks",
        "test_no_sync_launches_no_all_reduce",
    ),
    "tests/runtime/test_empty_concatenations.py": (
        "traces and trains GPT-2",
        "test_gpt2_cache_copies_are_dropped_and_it_trains_like_eager",
    ),
    "tests/runtime/test_executor.py": (
        "traces and trains the CNNs and GPT-2 (mlp's cases stay)",
        "test_default_plan_trains_like_eager[resnet18]",
        "test_default_plan_trains_like_eager[vgg11]",
        "test_default_plan_trains_like_eager[mobilenet_v2]",
        "test_default_plan_trains_like_eager[small_densenet]",
        "test_default_plan_trains_like_eager[gpt2]",
        "test_recomputation_plan_trains_like_eager[resnet18]",
        "test_recomputation_plan_trains_like_eager[vgg11]",
        "test_recomputation_plan_trains_like_eager[mobilenet_v2]",
        "test_recomputation_plan_trains_like_eager[small_densenet]",
        "test_recomputation_plan_trains_like_eager[gpt2]",
        "test_default_plan_peak_is_within_two_percent_of_eager",
        "test_checkpointing_lowers_the_measured_peak",
        "test_plan_for_another_shape_is_refused_naming_both_fingerprints",
        "test_plan_for_another_model_is_refused",
        "test_random_recomputation_schedules_train_like_eager",
        "test_random_recomputation_of_gpt2_dropouts_trains_like_eager",
    ),
    "tests/runtime/test_fused_gelu.py": (
        "traces and trains GPT-2's MLP",
        "test_gpt2_gelu_is_fused_and_trains_like_eager_with_and_without_recomputation",
        "test_sigmoid_variant_runs_every_fused_tanh_within_tolerance_at_the_simulated_peak",
    ),
    "tests/runtime/test_fused_loss.py": (
        "traces language-model heads with their loss",
        "test_capture_fuses_the_loss_saving_logits_tensors_with_eager_gradients",
        "test_the_whole_loss_fuses_when_the_backward_seed_comes_through_an_alias",
    ),
    "tests/runtime/test_native_weight_gradient.py": (
        "solves and trains a plan running every weight-gradient variant",
        "test_offered_on_every_weight_gradient_and_a_plan_running_it_trains_like_eager",
    ),
    "tests/runtime/test_olla_plans.py": (
        "OLLA plans of resnet18 and mobilenet_v2 (GPT-2's stays)",
        "test_olla_order_and_addresses_train_like_eager[resnet18]",
        "test_olla_order_and_addresses_train_like_eager[mobilenet_v2]",
    ),
    "tests/runtime/test_optim_slices.py": (
        "one optimizer per case, the rest of the optimizers (sgd stays)",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[adam-amsgrad-decay]",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[adamw]",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[adamw-foreach]",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[adamw-tensor-lr]",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[rmsprop]",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[sgd-dampening-maximize]",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[sgd-momentum]",
        "test_sliced_updates_give_eager_parameters_and_state_bitwise[sgd-nesterov-decay]",
    ),
    "tests/runtime/test_optim_step.py": (
        "one optimizer per case, the rest of the optimizers (sgd stays)",
        "test_parameters_after_three_steps_equal_eager[adamw]",
        "test_grouped_updates_give_eager_parameters_bitwise[adam-amsgrad-decay]",
        "test_grouped_updates_give_eager_parameters_bitwise[adamw]",
        "test_grouped_updates_give_eager_parameters_bitwise[adamw-foreach]",
        "test_grouped_updates_give_eager_parameters_bitwise[adamw-tensor-lr]",
        "test_grouped_updates_give_eager_parameters_bitwise[rmsprop]",
        "test_grouped_updates_give_eager_parameters_bitwise[sgd-dampening-maximize]",
        "test_grouped_updates_give_eager_parameters_bitwise[sgd-momentum]",
        "test_grouped_updates_give_eager_parameters_bitwise[sgd-nesterov-decay]",
    ),
    "tests/runtime/test_plan_addresses.py": (
        "traces resnet18 (the module's `planned`; mlp's cases stay)",
        "test_greedy_addresses_pass_and_all_overlapping_addresses_are_refused[resnet18]",
        "test_moved_addresses_are_refused_exactly_when_the_simulator_refuses_them[resnet18]",
        "test_misaligned_and_corrupt_offsets_are_refused[resnet18]",
        "test_an_overlapping_plan_is_refused_before_any_step_runs[resnet18]",
    ),
    "tests/runtime/test_policy.py": (
        "policy plans trained on GPT-2 and Llama, some under torch.compile",
        "test_policy_plan_trains_like_eager_at_the_predicted_peak",
        "test_policy_plan_under_torch_compile",
        "test_round_trip_of_decisions_and_solver_schedules",
        "test_a_split_plan_under_torch_compile",
        "test_no_single_change_to_the_solvers_decision_fits_and_costs_less",
        "test_nested_layers_train_like_eager_at_the_predicted_peak[llama-1]",
    ),
    "tests/runtime/test_policy_dispatch.py": (
        "profiles and solves policy-form graphs",
        "test_the_profile_measures_the_dispatch_of_a_policy_form_graph_and_the_store_keeps_it",
        "test_the_solver_checkpoints_whole_where_the_dispatch_outweighs_what_a_policy_saves",
        "test_a_plan_carries_its_dispatch_cost_in_its_predicted_time",
        "test_a_malformed_dispatch_cost_is_refused",
    ),
    "tests/runtime/test_policy_frame.py": (
        "trains a checkpointed region",
        "test_a_checkpointed_regions_outside_input_is_held_through_its_backward_as_predicted",
    ),
    "tests/runtime/test_policy_optimizer.py": (
        "policy plans with the optimizer inside the step, trained",
        "test_policy_plans_update_like_eager_at_the_predicted_peak",
    ),
    "tests/runtime/test_policy_saves.py": (
        "trains a policy plan",
        "test_saved_projections_are_not_rerun_and_the_peak_is_predicted",
    ),
    "tests/runtime/test_rewrite_check.py": (
        "checks and trains GPT-2's rewrites",
        "test_the_rewrites_check_exact_on_this_cpu_and_the_graph_trains_bit_for_bit",
        "test_a_rewrite_one_ulp_off_is_found_inexact_and_not_applied",
        "test_a_recorded_selection_makes_the_graph_independent_of_the_thread_count",
        "test_a_refused_plan_says_which_batch_it_was_made_for",
    ),
    "tests/runtime/test_torchtitan_schedule.py": (
        "trains the schedule, solves the exact MILP",
        "test_the_schedule_trains_like_eager_at_its_simulated_peak",
        "test_the_exact_milp_is_at_least_as_cheap_within_the_schedules_peak",
    ),
    "tests/runtime/test_variant_rules.py": (
        "traces and trains CNNs under every variant rule and MONeT plans",
        "test_each_rule_and_all_rules_train_like_eager_at_the_simulated_peak",
        "test_monet_plans_at_three_budgets_train_like_eager_at_the_simulated_peak",
    ),
    "tests/runtime/test_variants.py": (
        "traces and trains CNNs under variant plans",
        "test_mask_plan_trains_exactly_like_eager_at_the_simulated_peak",
        "test_in_place_relu_trains_exactly_like_eager_at_the_simulated_peak_and_in_arena_mode",
        "test_backward_mask_without_the_forward_mask_is_refused",
        "test_variant_value_ids_do_not_depend_on_the_rules_chosen",
    ),
    # tests/solve
    "tests/solve/test_acg_search.py": (
        "exhaustive searches to compare with",
        "test_lcg_and_acg_match_exhaustive_on_chains",
        "test_acg_matches_exhaustive_on_random_dags",
        "test_forced_checkpoints_are_kept_and_optimal",
        "test_division_tree_partitions_every_segment",
    ),
    "tests/solve/test_acg_solver.py": (
        "solves at many budgets",
        "test_budget_mode_never_recomputes_more_than_the_memory_optimum",
    ),
    "tests/solve/test_baselines.py": (
        "every heuristic on every benchmark graph",
        "test_every_heuristic_on_every_benchmark_graph",
        "test_segment_baselines_cost_at_most_one_extra_forward",
    ),
    "tests/solve/test_checkmate.py": (
        "MILPs on larger graphs, to a time limit",
        "test_ilp_finds_the_exhaustive_optimum_on_linear_graphs[6]",
        "test_ilp_finds_the_exhaustive_optimum_on_linear_graphs[7]",
        "test_model_memory_is_the_simulator",
        "test_approx_is_feasible_and_bracketed_by_the_optimum",
        "test_time_limit_returns_the_incumbent_with_its_gap",
        "test_warm_start_within_gap_skips_the_milp",
        "test_expensive_solvers_are_never_worse_than_the_cheap_ones",
    ),
    "tests/solve/test_dtr.py": (
        "exhaustive searches to compare with",
        "test_valid_and_never_below_the_exhaustive_optimum",
    ),
    "tests/solve/test_feasible_budgets.py": (
        "a larger MILP",
        "test_checkmate_charges_each_nodes_workspace[5-2-2]",
    ),
    "tests/solve/test_hierarchical.py": (
        "brute force and MILPs to compare with",
        "test_chain_program_equals_brute_force",
        "test_chain_estimate_bounds_the_simulated_peak",
        "test_hierarchical_fits_budgets_the_segment_baselines_cannot",
        "test_below_its_reach_the_portfolio_answers_with_a_cheap_solver_as_feasible",
    ),
    "tests/solve/test_json_stdout.py": (
        "a `memplan solve` process",
        "test_a_solver_writing_to_stdout_leaves_solve_json_parseable",
    ),
    "tests/solve/test_monet.py": (
        "MONeT MILPs against Checkmate and brute force",
        "test_monet_noop_is_within_ten_percent_of_checkmate",
        "test_monet_with_in_place_relu_equals_brute_force_and_in_place_lowers_the_smallest_budget",
    ),
    "tests/solve/test_olla.py": (
        "an exhaustive search to compare with",
        "test_lifetime_ilp_peak_equals_exhaustive_search",
    ),
    "tests/solve/test_overhead_search.py": (
        "budget sweeps against brute force",
        "test_the_plan_is_the_least_peak_schedule_within_the_overhead_limit",
        "test_a_heuristic_solvers_plan_is_the_least_peak_of_its_budget_sweep_within_the_limit[dtr]",
        "test_more_overhead_buys_less_memory_down_to_the_floor",
    ),
    "tests/solve/test_problem.py": (
        "traces models to load their variants",
        "test_load_offers_the_variants_a_plan_allows",
    ),
    "tests/solve/test_variants_addresses.py": (
        "places addresses on every benchmark graph",
        "test_greedy_placement_is_valid_and_between_the_live_bound_and_the_sum",
    ),
    # tests/structure
    "tests/structure/test_cache_keys.py": (
        "edits each dependency and recomputes the keys",
        "test_an_edit_to_each_dependency_misses_the_cache",
        "test_an_edit_outside_the_closure_keeps_the_key",
    ),
    "tests/structure/test_lint.py": (
        "mypy reads the solver core and what it imports, ~30 s without its cache",
        "test_mypy_passes_on_the_solver_core",
    ),
    "tests/structure/test_package.py": (
        "a process importing memplan from elsewhere",
        "test_a_users_own_runtime_and_tasks_do_not_shadow_memplan",
    ),
}
"""The fast lane, `pytest -m "not slow"` (docs/install.md): what takes seconds on a 2-core CPU, marked `slow`. A
module's path with why, for a module none of whose tests is cheap; or (why, its slow tests...), each test by name (every
parametrization) or name[id] (one). A module with cheap tests keeps them in the fast lane (which still imports every
module). tests/structure/test_fast_lane.py checks the names."""


def slow_reason(nodeid: str) -> str | None:
    """Why the test `nodeid` is in SLOW, or None."""
    module, _, test = nodeid.partition("::")
    entry = SLOW.get(module)
    if isinstance(entry, str):
        return entry
    if entry and (test in entry[1:] or test.split("[", 1)[0] in entry[1:]):
        return entry[0]
    return None


@pytest.hookimpl(tryfirst=True)             # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """Marks SLOW's tests `slow`; then the LONGEST_FIRST units first, in that order (with `--no-loadscope-reorder`
    work units go out in collection order): long units start at once instead of ending the run on one worker while
    the others have finished (longest-first scheduling), then the rest in collection order."""
    for item in items:
        if (reason := slow_reason(item.nodeid)) is not None:
            item.add_marker(pytest.mark.slow(reason=reason))
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(LONGEST_FIRST)))
