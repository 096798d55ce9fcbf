"""The hostile-input gauntlet (issue 7): corpus, runner and the secured test bed."""
