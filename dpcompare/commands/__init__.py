"""The commands built on the library: compare, report, bench-collectives. They import the library;
nothing in the library imports them (a rank of a run never loads a command module)."""
