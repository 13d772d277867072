import cProfile, pstats
import test_gpu_delta_net as t
def test_prof():
    pr = cProfile.Profile(); pr.enable()
    t.run_prefill([1, 5, 64, 65, 130], [3, 0, 6, 1, 5], [True, False, True, False, True])
    pr.disable(); pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
