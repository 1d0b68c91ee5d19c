"""The learner: jitted, sharded log-prob recomputation and the policy update over packed rows."""
