"""A run's training crop sizes: progressive resizing's ramp (--resolution-schedule), the bounds of
every crop size, and the header's word on the crops. The loop asks them per epoch through the
EpochPlan (train/schedule.py)."""


class ResolutionRamp:
    """Progressive resizing (--resolution-schedule 'START:END:FROM:TO[:STEP]'): the training crop size
    of an epoch, START until FROM epochs are done, END once TO are, and between them a straight line
    in the epochs done rounded to the nearest multiple of STEP (32 unless given), as FFCV's ImageNet
    example ramps it. Small crops early are cheap (a step's work grows with the pixels) and, with the
    evaluation at a higher resolution, cost little accuracy (Touvron et al. 2019)."""

    def __init__(self, start: int, end: int, first: int, last: int, step: int = 32):
        self.start, self.end, self.first, self.last, self.step = start, end, first, last, step

    def __call__(self, epoch: int) -> int:
        """The crop size of the epoch (0-based: `epoch` epochs are done before it)."""
        if epoch >= self.last:
            return self.end
        if epoch <= self.first:
            return self.start
        size = self.start + (self.end - self.start) * (epoch - self.first) / (self.last - self.first)
        rounded = round(size / self.step) * self.step  # (half to even, as numpy's round in FFCV's)
        return min(max(rounded, min(self.start, self.end)), max(self.start, self.end))

    def sizes(self, epochs: int) -> list[int]:
        return [self(epoch) for epoch in range(epochs)]


# every crop size in px (--image-size, --eval-image-size, the ramp's ends; docs/time_to_accuracy.md)
MIN_CROP, MAX_CROP = 16, 1024
NO_RAMP = ("", "none", "off")  # --resolution-schedule's words for "no ramp"


def resolution_ramp(text: str) -> ResolutionRamp | None:
    """--resolution-schedule's ramp, None for '', 'none' or 'off'; a ValueError naming the flag, the
    value and what to give when it is not one."""
    if text.strip().lower() in NO_RAMP:
        return None
    flag_given, example = f"--resolution-schedule {text!r}", "e.g. 160:192:65:76"
    parts = [part.strip() for part in text.split(":")]
    if len(parts) not in (4, 5):
        raise ValueError(f"{flag_given}: has {len(parts)} value{'s' if len(parts) > 1 else ''}, not 4 or 5; give "
                         f"START:END:FROM:TO[:STEP], {example}")
    numbers = []
    units = ("pixels", "pixels", "epochs", "epochs", "pixels")
    for part, name, unit in zip(parts, ("START", "END", "FROM", "TO", "STEP"), units):
        try:
            numbers.append(int(part))
        except ValueError:
            what = f"{part} is not a whole number" if _is_number(part) else f"{part!r} is not a number"
            raise ValueError(f"{flag_given}: {name} {what} of {unit}; give whole {unit}, {example}") from None
    start, end, first, last, step = numbers + [32] * (5 - len(numbers))
    for name, size in (("START", start), ("END", end)):
        if not MIN_CROP <= size <= MAX_CROP:
            raise ValueError(f"{flag_given}: {name} {size} is not a crop size from {MIN_CROP} to {MAX_CROP} px; give one "
                             f"in that range, {example}")
    if step < 8 or step % 8:
        raise ValueError(f"{flag_given}: STEP {step} is not a positive multiple of 8 (the ramp rounds its sizes to multiples of "
                         "STEP); give 8, 16, 32 or another multiple of 8, e.g. 160:192:65:76:32")
    if first < 0:
        raise ValueError(f"{flag_given}: FROM {first} is not 0 or more; give the epochs done before the ramp, {example}")
    if last < first:
        raise ValueError(f"{flag_given}: FROM {first} is after TO {last}; give FROM not above TO, {example}")
    return ResolutionRamp(start, end, first, last, step)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def crop_note(cfg) -> str:
    """The header's word on a run's training crops, "" when there is none to say: the ramp and the
    evaluation size an explicit --image-size left out (train/cli.py), a ramp that never moves within the run's epochs (the crop
    size it keeps), a ramp that shrinks."""
    notes = [f"{cfg.left_out} left out: --image-size {cfg.image_size} given"] if cfg.left_out else []
    ramp = resolution_ramp(cfg.resolution_schedule)
    if ramp and ramp.start != ramp.end:
        if set(ramp.sizes(cfg.epochs)) == {ramp.start}:
            why = f"FROM {ramp.first}" if ramp.first >= cfg.epochs - 1 else f"rounded to multiples of {ramp.step}"
            notes.append(f"the ramp keeps {ramp.start} px crops throughout this {cfg.epochs}-epoch run ({why})")
        elif ramp.end < ramp.start:
            notes.append(f"the ramp shrinks the training crops from {ramp.start} to {ramp.end} px")
    return "; ".join(notes)


def training_crops(image_size: int, resolution_schedule: str) -> tuple[int, int]:
    """The smallest and the largest training crop of a run (the ramp's steps stay between its ends)."""
    ramp = resolution_ramp(resolution_schedule)
    return (min(ramp.start, ramp.end), max(ramp.start, ramp.end)) if ramp else (image_size, image_size)


def largest_image_size(cfg) -> int:
    """The largest training crop of a run (what its per-GPU batch must fit)."""
    return training_crops(cfg.image_size, cfg.resolution_schedule)[1]
