"""`make bench`: run every benchmark in turn."""

from benchmarks import assembly_bench, codec_bench

if __name__ == "__main__":
    codec_bench.main()
    assembly_bench.main()
