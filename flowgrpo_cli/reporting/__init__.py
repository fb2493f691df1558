"""What a person reads: progress bars, terminal tables, sample grids, the HTML report and
`flowgrpo inspect`."""
