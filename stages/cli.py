def main() -> None:
    print("dhp")
