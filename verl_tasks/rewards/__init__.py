"""Reward functions with verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``
signature, and the sandbox that runs them."""
