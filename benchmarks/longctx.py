"""``python -m benchmarks.longctx``: whole-model long context vs ALST, issue 22 (:data:`benchmarks.hf.LONGCTX`)."""

from benchmarks import driver, hf

if __name__ == "__main__":
    raise SystemExit(driver.main(hf.LONGCTX))
