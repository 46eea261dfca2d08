"""What the per-rank families share: rank file names, one rank's file, the check that a
directory's files are one save, target ranks and their writer base, chunk labels."""
