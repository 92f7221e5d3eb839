"""``xnn traj merge DIR -o OUT``: a sharded trajectory (``trajectory.d/``, one file per rank
of a decomposed run) as one file of frames in atom-id order."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("traj", help="trajectory utilities (merge a sharded trajectory)",
                       description="Trajectory utilities.")
    tsub = p.add_subparsers(dest="traj_command", metavar="ACTION", required=True)
    merge = tsub.add_parser(
        "merge", help="a sharded trajectory (trajectory.d/) as one extxyz file",
        description="Read the per-rank files of a sharded trajectory (output."
        "trajectory_format=sharded) and write every frame, atoms in id order, to one file "
        "(extxyz for .xyz/.extxyz, else the ASE format of the suffix).")
    merge.add_argument("folder", help="the trajectory folder (OUT/trajectory.d)")
    merge.add_argument("-o", "--out", required=True, help="output file, e.g. traj.extxyz")
    merge.set_defaults(func=run_merge)


def run_merge(args) -> int:
    from xnn.io.sharded_trajectory import merge_trajectory

    n = merge_trajectory(args.folder, args.out)
    print(f"xnn traj merge: {n} frames written to {args.out}")
    return 0
