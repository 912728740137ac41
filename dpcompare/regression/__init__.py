"""dpcompare's ready regression suite: `pytest --pyargs dpcompare.regression` runs every installed backend at
the world sizes and on the model given by the --dpcompare-* options, one pytest-benchmark benchmark per
backend x world size (node id `test_step_time[BACKEND-wsN]`, grouped by model), whose rounds are the run's
measured steps on their slowest rank. Save and compare with pytest-benchmark's own options."""
