"""The params layer: one `ParamState` record per managed param and its tier (`params`), partition
math and gather/release (`gather`), and the records the layers above fill in for those below: who runs
a param (`runners`), where new params go (`placing`), and Init's access mode (`_access`)."""
