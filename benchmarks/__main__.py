"""`make bench`: run every benchmark in turn."""

from benchmarks import codec_bench

if __name__ == "__main__":
    codec_bench.main()
