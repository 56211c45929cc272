"""trioserve benchmarks: ``python -m bench`` runs them all (the runner, bench/runner.py; the report
writer, bench/report.py). Each ``bench/*_bench.py`` is a section, also runnable on its own as
``python -m bench.<name>``; sections share only the library, bench/lib/ (and testkit/)."""
